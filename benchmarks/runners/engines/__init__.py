"""One runner per engine (base.py: what runners.run needs from one); each imports its engine
only when its make_runner() is called."""
