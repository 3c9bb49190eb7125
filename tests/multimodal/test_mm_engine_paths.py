"""Image requests through the engine's harder paths: preemption (recompute, image rows again),
the `--image` CLI flag, and a text-only model refusing images."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmemo import LLM, SamplingParams
from tests.multimodal.tiny_llava import picture

REPO = Path(__file__).resolve().parents[2]


def test_preempted_image_requests_recompute_the_same_tokens(llava, llm_off) -> None:
    # 12 blocks of 8 tokens for 6 requests of ~30 prompt + 24 output tokens: the pool runs out
    # mid-decode, so the newest requests are preempted and recompute their image rows.
    small = LLM(
        model=str(llava[0]), device="cpu", block_size=8, num_blocks=12, max_num_batched_tokens=32
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [
        {
            "prompt": f"USER: <image>\nPicture {i}: what is it? ASSISTANT:",
            "images": [picture(800 + i % 3)],
        }
        for i in range(6)
    ]
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.get_metrics().num_preemptions > 0
    expected = llm_off.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]


def test_cli_image_flag(llava, llm_off, tmp_path) -> None:
    path = tmp_path / "pic.png"
    picture(810).save(path)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmemo.cli",
            "generate",
            "What is this?",
            "--model",
            str(llava[0]),
            "--device",
            "cpu",
            "--image",
            str(path),
            "--max-tokens",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    # No <image> marker in the prompt: the image goes first.
    expected = llm_off.generate(
        {"prompt": "<image>\nWhat is this?", "images": [str(path)]},
        SamplingParams(temperature=0.0, max_tokens=4),
        use_tqdm=False,
    )[0]
    assert out["token_ids"] == expected.outputs[0].token_ids
    assert out["prompt_tokens"] == len(expected.prompt_token_ids)


@pytest.mark.model
def test_text_only_model_refuses_images(llm) -> None:
    with pytest.raises(ValueError, match="does not accept images"):
        llm.generate({"prompt": "Hi", "images": [picture(1)]}, use_tqdm=False)
    chat = [{"role": "user", "content": [{"type": "image", "image": picture(1)}]}]
    with pytest.raises(ValueError, match="does not accept images"):
        llm.chat(chat, use_tqdm=False)
    # Text parts alone are fine on any model.
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert (
        llm.chat(text_parts, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    )
