"""`python -m kvmemo.cli`: the same as the `kvmemo` command."""

import sys

from kvmemo.cli import main

sys.exit(main())
