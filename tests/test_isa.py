"""KVMEMO_ISA: one switch makes every layer (torch's ATen kernels, oneDNN, MKL, kvmemo's C kernels
and probes) compute at a level at or below the CPU's own; a level the CPU cannot run, or a kernel
it cannot run at the forced level, is one line naming the missing feature and what is allowed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvmemo import isa

AVX512_MACHINE = frozenset(
    "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2 abm movbe xsave avx512f avx512bw avx512vl "
    "avx512dq avx512_vnni avx512_bf16 avx_vnni amx_tile amx_bf16 amx_int8 gfni".split()
)
AVX2_MACHINE = frozenset(
    "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2 abm movbe xsave".split()
)
NATIVE = isa.native_level()


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to be an x86-64 CPU with the given flags."""
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")

    def pretend(flags: frozenset[str]) -> None:
        monkeypatch.setattr(isa, "raw_cpu_flags", lambda: flags)

    return pretend


def test_an_unknown_level_names_the_allowed_ones(monkeypatch):
    monkeypatch.setenv("KVMEMO_ISA", "avx9")
    with pytest.raises(isa.IsaError) as err:
        isa.forced()
    assert str(err.value) == ("KVMEMO_ISA must be one of native, scalar, avx2, avx512; "
                              "got 'avx9'")


def test_a_level_above_the_cpu_names_the_missing_features(monkeypatch, cpu):
    cpu(AVX2_MACHINE)
    monkeypatch.setenv("KVMEMO_ISA", "avx512")
    with pytest.raises(isa.IsaError) as err:
        isa.forced()
    message = str(err.value)
    assert "\n" not in message
    assert "avx512bw, avx512dq, avx512f, avx512vl" in message
    assert message.endswith("allowed here: native, scalar, avx2")
    assert isa.native_level() == "avx2"
    assert isa.levels_below_native() == ["scalar"]


def test_a_vm_hiding_a_flag_x86_64_v3_builds_use_is_not_taken_for_avx2(monkeypatch, cpu):
    cpu(AVX2_MACHINE - {"movbe"})
    assert isa.native_level() == "scalar"
    monkeypatch.setenv("KVMEMO_ISA", "avx2")
    with pytest.raises(isa.IsaError, match="needs the CPU feature.s. movbe"):
        isa.forced()


@pytest.mark.parametrize(
    "level,kept,hidden",
    [
        ("avx2", {"avx", "avx2", "fma", "f16c", "sse4_2"},
         {"avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8"}),
        ("scalar", {"sse2", "sse4_2"}, {"avx", "avx2", "fma", "f16c", "avx512f", "gfni"}),
        ("avx512", {"avx512f", "avx512_bf16", "avx512_vnni"}, {"amx_tile", "amx_bf16"}),
    ],
)
def test_a_forced_level_hides_the_flags_above_it(monkeypatch, cpu, level, kept, hidden):
    cpu(AVX512_MACHINE)
    monkeypatch.setenv("KVMEMO_ISA", level)
    flags = isa.cpu_flags()
    assert kept <= flags and not hidden & flags
    assert isa.active() == level
    monkeypatch.setenv("KVMEMO_ISA", "native")
    assert isa.cpu_flags() == AVX512_MACHINE and isa.active() == "avx512"


def test_bf16_products_and_onednn_bf16_follow_the_forced_level(monkeypatch, cpu):
    from kvmemo.model.layers import linear as linear_kernels
    from kvmemo.native import cpu_has_bf16_products

    cpu(AVX512_MACHINE)
    monkeypatch.setenv("KVMEMO_ISA", "avx2")
    assert not cpu_has_bf16_products()  # so dtype "auto" picks float32
    assert not linear_kernels.onednn_available.__wrapped__(torch.bfloat16)
    monkeypatch.setenv("KVMEMO_ISA", "native")
    assert cpu_has_bf16_products()


def test_apply_tells_torch_onednn_and_mkl_and_leaves_what_the_user_set(monkeypatch, cpu):
    cpu(AVX512_MACHINE)
    monkeypatch.setenv("KVMEMO_ISA", "scalar")
    environ = {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    isa.apply(environ)
    assert environ.pop("KVMEMO_ISA_SET") == "ATEN_CPU_CAPABILITY,ONEDNN_MAX_CPU_ISA,DNNL_MAX_CPU_ISA"
    assert environ == {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                       "DNNL_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    monkeypatch.setenv("KVMEMO_ISA", "native")
    untouched: dict[str, str] = {}
    isa.apply(untouched)
    assert untouched == {}


def test_a_child_process_at_another_level_redoes_what_its_parent_set(monkeypatch, cpu):
    cpu(AVX512_MACHINE)
    monkeypatch.setenv("KVMEMO_ISA", "scalar")
    environ = {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}  # the user's
    isa.apply(environ)  # the parent
    monkeypatch.setenv("KVMEMO_ISA", "avx2")
    isa.apply(environ)  # a child it started, asked for avx2
    assert environ["ATEN_CPU_CAPABILITY"] == "avx2" and environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert environ["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    monkeypatch.setenv("KVMEMO_ISA", "native")
    isa.apply(environ)  # a grandchild at the CPU's own level
    assert environ == {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def _run(code: str, level: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                        "MKL_ENABLE_INSTRUCTIONS")}
    env["KVMEMO_ISA"] = level
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("level,capability", [("avx2", "AVX2"), ("scalar", "DEFAULT")])
def test_importing_kvmemo_forces_torch_and_onednn_in_a_fresh_process(level, capability):
    if level not in isa.levels_below_native() and level != NATIVE:
        pytest.skip(f"this CPU runs {NATIVE}, below {level}")
    code = (
        "import kvmemo, torch\n"
        "from kvmemo.model.layers.linear import onednn_available\n"
        "print(torch.backends.cpu.get_cpu_capability(), onednn_available(torch.bfloat16))\n"
    )
    result = _run(code, level)
    assert result.returncode == 0, result.stderr
    got_capability, bf16_onednn = result.stdout.split()
    assert got_capability == capability
    assert bf16_onednn == "False"  # oneDNN refuses bf16 weights below AVX-512


def test_the_cli_reports_a_bad_level_in_one_line_and_exits_2():
    env = {**os.environ, "KVMEMO_ISA": "avx9"}
    result = subprocess.run([sys.executable, "-m", "kvmemo.cli", "generate", "hi"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: KVMEMO_ISA must be one of native, scalar, avx2, "
                                     "avx512; got 'avx9'")


def test_a_level_above_this_cpu_is_refused_by_the_cli():
    above = [name for name in isa.LEVELS if name not in (*isa.levels_below_native(), NATIVE)]
    if not above:
        pytest.skip(f"no level above this CPU's ({NATIVE}) to request")
    env = {**os.environ, "KVMEMO_ISA": above[-1]}
    result = subprocess.run([sys.executable, "-m", "kvmemo.cli", "isa"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: KVMEMO_ISA={above[-1]} needs the CPU feature")


def test_a_forced_kernel_the_level_cannot_run_is_one_line_naming_the_options(monkeypatch, cpu):
    from kvmemo.model.layers import linear as linear_kernels
    from kvmemo.model.layers import linear_probe

    cpu(AVX512_MACHINE)
    monkeypatch.setenv("KVMEMO_ISA", "avx2")
    monkeypatch.setenv("KVMEMO_LINEAR_KERNEL", "onednn")
    monkeypatch.setattr(linear_kernels, "onednn_available",
                        linear_kernels.onednn_available.__wrapped__)
    weights = [torch.randn(8, 8).to(torch.bfloat16)]
    with pytest.raises(ValueError) as err:
        linear_probe.choose_kernels(weights, torch.device("cpu"))
    message = str(err.value)
    assert message.startswith("KVMEMO_LINEAR_KERNEL=onednn cannot compute bfloat16 on this CPU "
                              "at the avx2 instruction-set level (oneDNN's bf16 needs avx512bw")
    assert "allowed here: torch" in message and "onednn," not in message


@pytest.mark.model
def test_the_cli_refuses_a_forced_kernel_the_forced_level_cannot_run():
    """A real AVX2 machine and an AVX-512 one forced to avx2 say the same one line, exit 2."""
    if "avx2" not in (*isa.levels_below_native(), NATIVE):
        pytest.skip(f"this CPU runs {NATIVE}, below avx2")
    env = {**os.environ, "KVMEMO_ISA": "avx2", "KVMEMO_LINEAR_KERNEL": "onednn"}
    result = subprocess.run(
        [sys.executable, "-m", "kvmemo.cli", "generate", "Hi", "--weights", "dense", "--dtype",
         "bfloat16", "--max-tokens", "2"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: KVMEMO_LINEAR_KERNEL=onednn cannot compute bfloat16 on this CPU at the avx2 "
        "instruction-set level (oneDNN's bf16 needs avx512bw, avx512vl and avx512dq, or "
        "avx_ne_convert); allowed here: torch, skinny"
    ]
