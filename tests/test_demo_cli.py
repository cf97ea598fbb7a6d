"""The main job (``gpuloom`` with no command: the engine demo) on the CPU path, and the consoles the
commands print tables through."""

from __future__ import annotations

from gpuloom import cli


def test_the_demo_compiles_a_model_and_prints_its_row_with_full_headers(capsys):
    rc = cli.main(["demo", "mobilenet_v3_small", "--size", "64", "--iters", "1", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "No CUDA GPU here: running the CPU path" in out
    row = next(line for line in out.splitlines() if line.startswith("│ mobilenet_v3_small"))
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells[0] == "mobilenet_v3_small" and int(cells[1]) > 50 and cells[4] == "-"  # ops; nothing kept on CPU
    assert cells[7].endswith("x") and float(cells[7][:-1]) > 0  # the speedup over eager
    for header in ("streams", "gpuloom ms", "speedup", "compile s"):  # a log gets them whole, not "spee…"
        assert header in out


def test_a_second_run_marks_the_compiles_whose_export_graph_came_from_the_cache(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("GPULOOM_GRAPH_CACHE", str(tmp_path))
    args = ["demo", "resnet18", "--size", "32", "--iters", "1", "--device", "cpu"]

    def compile_cell() -> str:
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if line.startswith("│ resnet18"))
        return [c.strip() for c in row.strip("│").split("│")][8], out

    assert cli.main(args) == 0
    cell, out = compile_cell()
    assert not cell.endswith("*") and "graph cache" not in out
    assert cli.main(args) == 0
    cell, out = compile_cell()
    assert cell.endswith(" *") and "from the graph cache" in out


def test_an_unknown_model_is_refused_with_its_name(capsys):
    assert cli.main(["demo", "no_such_net"]) == 2
    assert "unknown torchvision model 'no_such_net'" in capsys.readouterr().out


def test_tables_get_a_wide_console_when_printed_to_a_log():
    from gpuloom.commands.output import table_console

    console = table_console(150)  # pytest captures stdout: no terminal
    assert console.width == 150
