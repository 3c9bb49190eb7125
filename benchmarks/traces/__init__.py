"""Production request traces replayed through kvmemo's own block pool (issue 41)."""
