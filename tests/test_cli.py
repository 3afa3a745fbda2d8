"""The command line: fixed subcommands and flags, clear errors, exit codes."""

from __future__ import annotations

import json
import sys

from zerobubble.cli import main
from zerobubble.schedule.formats import json_format, torch_csv
from zerobubble.schedule.generators import GENERATORS, generate


def test_schedule_formats(capsys, tmp_path):
    assert main(["schedule", "zb-h1", "-p", "2", "-m", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "d0 |F0 F1 ...B0 W0 B1 W1 "
    out = tmp_path / "s.json"
    assert main(["schedule", "zbv", "-p", "3", "-m", "6", "--format", "json", "-o", str(out)]) == 0
    assert json_format.load(out) == generate("zbv", 3, 6)
    assert (
        main(["schedule", "1f1b", "-p", "2", "-m", "3", "--split-backward", "--format", "csv"]) == 0
    )
    assert (
        torch_csv.loads(capsys.readouterr().out).actions
        == generate("1f1b", 2, 3, split_backward=True).actions
    )
    assert (
        main(
            [
                "schedule",
                "interleaved-1f1b",
                "-p",
                "2",
                "-m",
                "4",
                "--chunks",
                "3",
                "--format",
                "json",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    assert json_format.load(out).num_stages == 6


def test_simulate_json_with_costs(capsys, tmp_path):
    path = tmp_path / "s.csv"
    main(["schedule", "zb-h1", "-p", "4", "-m", "8", "--format", "csv", "-o", str(path)])
    capsys.readouterr()
    assert main(["simulate", str(path), "--costs", "F=2,B=2,W=1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cost"] == 8 * (2 + 2 + 1) + 3 * (2 + 2 - 1)  # M(F+B+W) + (P-1)(F+B-W)
    assert data["bubble_time"] == 9
    assert len(data["idle"]) == 4


def test_compare_lists_every_kind_and_plots(capsys, tmp_path):
    """M = 3: every kind is searched and drawn, so the smallest M at which zb-h2 reaches
    its 3M at P = 2 (at M = 2 it takes 7)."""
    png = tmp_path / "c.png"
    assert main(["compare", "-p", "2", "-m", "3", "--json", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    data = json.loads(text[: text.rindex("]") + 1])
    assert [d["kind"] for d in data] == list(GENERATORS)
    by_kind = {d["kind"]: d for d in data}
    assert by_kind["zb-h2"]["cost"] == 9 and by_kind["1f1b"]["cost"] == 12  # 3M, 3(M+P-1)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_exits_2_with_a_message(capsys, tmp_path):
    assert main(["schedule", "zb-h1", "-p", "0", "-m", "4"]) == 2
    assert "number of devices P must be an integer >= 1" in capsys.readouterr().err
    assert main(["compare", "-p", "2", "-m", "2", "--costs", "F=x"]) == 2
    assert "cannot parse number" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0B0\n")
    assert main(["simulate", str(bad), "-m", "2"]) == 2
    assert "[missing]" in capsys.readouterr().err
    assert main(["schedule", "zb-h2", "-p", "4", "-m", "8", "--mem-limit", "6"]) == 2
    assert "[memory]" in capsys.readouterr().err


def test_train_refuses_bad_models_before_launching(capsys, monkeypatch):
    assert main(["bench", "--model", "gpt-5", "-p", "2"]) == 2
    assert "model.name 'gpt-5' is not a model of the job" in capsys.readouterr().err
    assert main(["bench", "--model", "hf-llama", "-p", "9"]) == 2
    err = capsys.readouterr().err
    assert "9 devices need at least 9 layers but hf-llama has 8" in err
    assert "--model.num-hidden-layers 7" in err
    assert main(["bench", "--model", "hf-gpt2", "-p", "2", "--seq-len", "129"]) == 2
    assert "takes rows of 2 to 128 tokens (its max_position_embeddings)" in capsys.readouterr().err
    assert main(["bench", "--model", "hf-gpt2", "--model.attn-implementation", "flash"]) == 2
    assert "sdpa or eager" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    assert main(["bench", "--model", "hf-llama", "-p", "2"]) == 2
    err = capsys.readouterr().err
    assert "--model hf-llama needs Hugging Face transformers" in err and "dev extra" in err


def test_schedule_format_program_prints_the_final_programs(capsys):
    argv = ["schedule", "1f1b", "-p", "2", "-m", "2", "--format", "program"]
    assert main([*argv, "--dp", "2", "--protocol", "speculative", "--rank", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [
        "# 1f1b: P=2, M=2, dp=2; fused, lookahead 2, grad sync reduce, protocol speculative",
        "rank 0 (stages 0): 18 instructions",
    ]
    assert lines[8:10] == [
        "   6  replay gate (0 stale messages to drain on a replay)",
        "   7  post_recv grad(s1->s0,mb0) from device 1",
    ]
    assert lines[-3:] == ["  15  reduce_grads s0", "  16  wait_sends", "  17  wait_reduce"]
    # A V kind at P=3 with FSDP: rank 2 holds stages 2 and 3; each is gathered before its F.
    assert main(["schedule", "zbv", "-p", "3", "-m", "3", "--format", "program", "--dp", "2",
                 "--fsdp", "--rank", "2"]) == 0  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert out[1:4] == [
        "rank 2 (stages 2, 3): 38 instructions",
        "   0  post_recv act(s1->s2,mb0) from device 1",
        "   1  post_recv act(s1->s2,mb1) from device 1",
    ]
    assert out.index("   3  unshard(s2)") < out.index("   4  F(s2,mb0)")
    assert sum("reduce_scatter" in x for x in out) == 2
    for bad in (["--rank", "2"], ["--fsdp"]):
        assert main([*argv, *bad]) == 2
        assert "zerobubble schedule: error:" in capsys.readouterr().err
