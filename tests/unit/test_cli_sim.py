"""`kvrs sim EXPERIMENT` puts its headline numbers and table on the terminal."""

from __future__ import annotations

import re

import yaml

from kvrs.cli import main


def test_sim_rom_crossover_prints_q_star_and_its_table_on_stdout(tmp_path, capsys):
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump({"surface": {"tokens": [512], "bandwidth_gbps": [25]}}))
    out = tmp_path / "out"
    status = main(
        ["sim", "rom-crossover", "--config", str(config), "--out", str(out), "--no-progress"]
    )
    printed = capsys.readouterr()
    assert status == 0
    assert re.search(r"Q\* analytic 6\.45\d, simulated 6\.45\d", printed.out), printed.out
    assert "| Q | local (s) | migrate (s) |" in printed.out
    figures = re.findall(r"^figure: (\S+)$", printed.out, flags=re.M)
    assert figures and all(path.endswith(".png") for path in figures)
    assert (out / "rom-crossover_curves.png").as_posix() in figures
    assert f"results in {out}" in printed.err
