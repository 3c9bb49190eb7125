"""`python -m kvmemo.cli`: the same as the `kvmemo` command."""

from kvmemo.cli import run

run()
