"""`switchboard bench quality` refuses bad arguments before it loads a model: a format a shard would refuse
used to be found only after the float32 and bfloat16 reference runs (minutes), as a traceback, and
`--prompts 0` ended in `max() arg is an empty sequence`. No model is run here.

    .venv/bin/python -m pytest tests/data_plane/test_bench_quality_args.py -q
"""

from __future__ import annotations

import pytest

from data_plane.bench import quality


@pytest.fixture(autouse=True)
def no_model_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("bench quality loaded a model for arguments it should have refused")

    monkeypatch.setattr(quality, "_runner", refuse)
    monkeypatch.setattr(quality, "measure", refuse)


@pytest.mark.parametrize(("argv", "said"), [
    (["--formats", "foo"], "dtype must be one of"),
    (["--formats", "float32:int9"], "quantization must be one of"),
    (["--formats", "float32:int4:bogus"], "kernel must be one of"),
    (["--formats", "float16:int4:blockq_x2"], "blockq_x2 takes float32 or bfloat16"),
    (["--prompts", "0"], "--prompts and --tokens take 1 or more"),
    (["--tokens", "-1"], "--prompts and --tokens take 1 or more"),
])
def test_bad_arguments_are_a_usage_error_before_any_model_loads(argv: list[str], said: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        quality.main(argv)
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err


def test_the_help_names_the_kernel_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        quality.main(["--help"])
    assert "DTYPE:QUANTIZATION[:KERNEL]" in capsys.readouterr().out
