"""What `moepeak demo` prints and draws: one parameter-count format, a reason beside the
rows that cannot differ on CPU, one colour per arm in every panel of the PNG."""
import pytest

from moepeak.demo import run
from test_demo import TINY

QUIET = TINY.index("--quiet")
LOUD = TINY[:QUIET] + TINY[QUIET + 1:]  # TINY without --quiet


def test_cpu_peak_table_says_why_boundaries_and_optimizer_are_equal(capsys):
    r = run(LOUD + ["--steps", "1"])
    out = capsys.readouterr().out
    rows = {row["peak"]: row for row in r["peaks"]}
    # on CPU both runs hold the boundaries and the optimizer state in host RAM: the same bytes
    # (StreamAdamW's state: plain AdamW's two moments plus a few bytes of step counters)
    assert rows["boundaries"]["moepeak"] == rows["boundaries"]["plain"]
    assert abs(rows["optimizer"]["moepeak"] / rows["optimizer"]["plain"] - 1) < 0.01
    table_rows = [line for line in out.splitlines() if line.startswith(("boundaries ", "optimizer "))]
    assert len(table_rows) == 2 and all(" 1.0x " in line for line in table_rows), table_rows
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 2, out
    assert notes[0].startswith("note: boundaries 1.0x: SCO moves") and "host RAM" in notes[0], notes
    assert notes[1].startswith("note: optimizer 1.0x: StreamAdamW") and "host RAM" in notes[1], notes
    # the parameter count in the one format the plot title uses too (TINY: 32480 parameters)
    assert "model: 0.0325 M params;" in out, out


def test_plain_cpu_run_gives_no_note(capsys):
    run(LOUD + ["--steps", "1", "--plain"])
    assert "note: " not in capsys.readouterr().out


def test_params_text_has_one_format():
    from moepeak.demo.config import MoEConfig
    from moepeak.demo.train import params_text
    cpu = MoEConfig(vocab_size=264, hidden=64, layers=2, heads=4, kv_heads=2, experts=8, intermediate=64)
    gpu = MoEConfig(vocab_size=65536, hidden=1024, layers=4, heads=8, kv_heads=2, experts=16, intermediate=512)
    assert params_text(cpu) == "0.256 M params" and params_text(gpu) == "245 M params"


def test_plot_gives_each_arm_one_colour_in_every_panel(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.colors as mcolors
    import matplotlib.pyplot as plt
    from moepeak.demo.plot import plot_run

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    plain = {"losses": [5.0, 4.001, 3.5], "note": ""}
    rows = [{"peak": k, "moepeak": 1 << 20, "plain": 2 << 20} for k in ("dispatch", "vocab", "boundaries", "optimizer")]
    assert plot_run(str(tmp_path / "p.png"), [5.0, 4.0, 3.5], 0, plain, rows, "title", lambda *a: None)
    loss_ax, _, peaks_ax = figs[0].axes[:3]
    def colour(artist):
        return mcolors.to_hex(artist.get_color() if hasattr(artist, "get_color") else artist.get_facecolor())
    lines = {line.get_label(): colour(line) for line in loss_ax.get_lines()}
    bars = {c.get_label(): {colour(p) for p in c.patches} for c in peaks_ax.containers}
    assert bars["moepeak"] == {lines["moepeak"]} and bars["plain PyTorch"] == {lines["plain PyTorch (3 steps)"]}
    assert lines["moepeak"] != lines["plain PyTorch (3 steps)"]
