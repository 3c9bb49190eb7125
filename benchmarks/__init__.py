"""kvmemo's benchmarks, one package, every script run as a module from the repository root.

    python -m benchmarks.runners.run_core            # kvmemo core figures (make bench)
    python -m benchmarks.runners.run_suite           # workloads W0-W4, engines side by side
    python -m benchmarks.micro.bench_attention       # one micro-benchmark; --help on any of them
    python -m benchmarks.report.write_docs           # docs/benchmarks.md from benchmarks/results/

Layout:
    paths.py, machine_info.py, workloads.py   shared: where files live, which CPU, the workloads
    runners/     the drivers (run, run_suite, run_core) and runners/engines/, one runner per engine
    micro/       focused benchmarks of one component each (attention, fp8, disk store, router, ...)
    report/      results -> charts (plot) and docs/benchmarks.md (write_docs, appends notes.md)
    peers/       setup scripts for the peer engines' virtualenvs (llama.cpp, HF, vLLM)
    data/, results/, notes.md   inputs, result JSON, hand-written analysis

Invariant: nothing here edits the import path; a module imports its siblings as
`benchmarks.<...>`, which resolves because `python -m` (and pytest) put the repository root on the
path. This __init__, paths, machine_info, workloads (at import), runners/__init__, runners.run and
runners/engines/* import only the standard library at module level: runners.run is also started
inside the peers' virtualenvs, which have no kvmemo, torch or numpy (see runners/run.py).
"""

import os

# The side-by-side figures (W0-W4, serve, fp8, ...) compare kvmemo with peers that load the same
# model dense in the same dtype, so kvmemo runs its dense weights there too (weights="auto"
# would pick native for the GGUF). The GGUF benchmarks (bench_gguf, bench_native_quality,
# bench_footprint) choose weights explicitly.
os.environ.setdefault("KVMEMO_WEIGHTS", "dense")
# Likewise each figure names its dtype: auto (bf16 on CPUs with bf16 products) would change the
# dtype with the machine; the side-by-side runs pass --dtype for every engine.
os.environ.setdefault("KVMEMO_DTYPE", "float32")
