"""`kvrs calibrate` measures the worker model and writes a profile the cost model loads."""

from __future__ import annotations

import json

from kvrs.cli import main
from kvrs.profile import ComputeProfile


def test_calibrate_writes_a_loadable_fitted_profile(tmp_path, capsys):
    output = tmp_path / "tiny.json"
    status = main(
        [
            "calibrate",
            "--model",
            "tiny",
            "--lengths",
            "8,16,32,64",
            "--repeats",
            "1",
            "--extend-new-tokens",
            "4",
            "--batch-sizes",
            "1,4",
            "--output",
            str(output),
        ]
    )
    assert status == 0
    report = json.loads(capsys.readouterr().out)
    profile = ComputeProfile.load(output)
    assert profile.model == "tiny"
    assert [tokens for tokens, _ in profile.table] == [8, 16, 32, 64]
    assert all(seconds > 0 for _, seconds in profile.table)
    assert profile.prefill_s(64) >= profile.prefill_s(8) > 0
    # Beyond the table the fitted quadratic continues: never a flat clamp.
    assert profile.prefill_s(4096) > profile.prefill_s(64)
    assert report["profile"] == profile.to_json()
    assert [row["cached_tokens"] for row in report["extend_check"]] == [8, 32]
    assert all(row["measured_s"] > 0 and row["predicted_s"] > 0 for row in report["extend_check"])
    # Batched passes, as the workers run them: prompts together, decode steps together.
    assert profile.batch is not None
    measured = {(row["pass"], row["sequences"]) for row in report["batch_fit_vs_measured"]}
    assert measured == {("prefill", 1), ("prefill", 4), ("decode", 1), ("decode", 4)}
    assert all(row["measured_s"] > 0 for row in report["batch_fit_vs_measured"])
    assert profile.batch_s([(0, 32)] * 4) > profile.batch_s([(0, 32)]) > 0


def test_calibrate_names_the_bad_flag(tmp_path, capsys):
    status = main(
        [
            "calibrate",
            "--model",
            "tiny",
            "--lengths",
            "8,nine",
            "--output",
            str(tmp_path / "x.json"),
        ]
    )
    assert status == 2
    assert "--lengths" in capsys.readouterr().err
    status = main(["calibrate", "--model", "gpt-9", "--output", str(tmp_path / "x.json")])
    assert status == 2
    assert "--model" in capsys.readouterr().err
    status = main(["calibrate", "--batch-sizes", "0,4", "--output", str(tmp_path / "x.json")])
    assert status == 2
    assert "--batch-sizes" in capsys.readouterr().err
