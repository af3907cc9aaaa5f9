"""bench/soak.py's command line: `--set` overrides keep their order, and one the job's config
refuses (a key it lacks, a value of the wrong type, no `=`) stops the soak in one line before
anything runs."""

from __future__ import annotations

import pytest

from bench import soak


def test_set_overrides_keep_their_order() -> None:
    args = soak.parse_args(["--set", "data.workers=1", "--set", "ckpt.schedule.policy=incremental", "--set", "data.workers=0"])
    assert args.overrides == ["data.workers=1", "ckpt.schedule.policy=incremental", "data.workers=0"]
    assert soak.parse_args([]).overrides == []


@pytest.mark.parametrize("bad", ["data.workers", "data.wrkers=1", "data.workers=two"])
def test_a_set_the_config_refuses_stops_the_soak_before_it_runs(
    bad: str, tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the soak ran")

    monkeypatch.setattr(soak, "soak", never)
    assert soak.main(["--set", bad, "--keep", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m bench.soak: --set: "), err
    assert bad.split("=")[0] in err[0], err  # names the culprit
