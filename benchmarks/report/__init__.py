"""From result JSON to what people read: `plot` (charts in docs/img/) and `write_docs`
(docs/benchmarks.md, with benchmarks/notes.md appended)."""
