"""The servers' step budget differs from a batch job's, and both stay overridable."""

from kvmemo.cli import build_parser, engine_options


def test_servers_step_in_smaller_chunks_than_generate() -> None:
    parser = build_parser()
    assert engine_options(parser.parse_args(["serve"]))["max_num_batched_tokens"] == 512
    assert engine_options(parser.parse_args(["ray-serve"]))["max_num_batched_tokens"] == 512
    assert engine_options(parser.parse_args(["generate", "hi"]))["max_num_batched_tokens"] == 2048
    chosen = parser.parse_args(["serve", "--max-num-batched-tokens", "4096"])
    assert engine_options(chosen)["max_num_batched_tokens"] == 4096
