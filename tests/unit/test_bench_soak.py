"""bench/soak.py's command line: `--set` overrides keep their order and a malformed one is refused
before anything runs."""

from __future__ import annotations

import pytest

from bench.soak import parse_args


def test_set_overrides_keep_their_order() -> None:
    args = parse_args(["--set", "data.workers=1", "--set", "ckpt.policy=incremental", "--set", "data.workers=0"])
    assert args.overrides == ["data.workers=1", "ckpt.policy=incremental", "data.workers=0"]
    assert parse_args([]).overrides == []


@pytest.mark.parametrize("bad", ["data.workers", "=1", "workers=1"])
def test_a_set_that_is_no_dotted_key_value_is_refused(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--set", bad])
    assert exc.value.code == 2
    assert f"{bad!r} is not KEY=VALUE" in capsys.readouterr().err
