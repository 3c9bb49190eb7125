"""kvmemo inside other serving systems (Ray Serve); each integration needs its own extra."""
