"""``deepinfer cache warm|stats|verify|clear`` on an L3 directory."""

from __future__ import annotations

import json

from tier_engine_helpers import GREEDY, flip, make, prompts

from deepinfer.cli import main as cli_main


def test_cache_cli_warm_stats_verify_clear(tiny_llama, tmp_path, capsys):
    disk = tmp_path / "l3"
    system = prompts(1, 64, seed=50)[0]
    pfile = tmp_path / "prompts.jsonl"
    pfile.write_text(json.dumps({"prompt_token_ids": system}) + "\n\n" + "plain text prompt line\n")
    args = ["--model", str(tiny_llama), "--page-size", "4", "--num-pages", "512",
            "--disk-cache-dir", str(disk)]
    assert cli_main(["cache", "warm", str(pfile), *args]) == 0
    warm = json.loads(capsys.readouterr().out)
    assert warm["prompts"] == 2 and warm["flushed"] and warm["disk_files"] >= 15
    assert cli_main(["cache", "stats", "--disk-cache-dir", str(disk)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["files"] == warm["disk_files"] and stats["bytes"] > 0
    # a request sharing the warmed system prompt hits it from L3
    llm = make(tiny_llama, disk)
    o = llm.generate(system + prompts(1, 10, seed=51)[0], GREEDY)[0]
    assert o.cached_tokens_by_tier["disk"] == 64
    llm.engine.shutdown()
    flip(next(disk.glob("??/*.kv")))
    assert cli_main(["cache", "verify", "--disk-cache-dir", str(disk)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["checksum_failures"] == 1 and report["ok"] == report["checked"] - 1
    assert cli_main(["cache", "verify", "--disk-cache-dir", str(disk)]) == 1  # only a report
    capsys.readouterr()
    assert cli_main(["cache", "verify", "--repair", "--disk-cache-dir", str(disk)]) == 1
    assert json.loads(capsys.readouterr().out)["repaired"] == 1
    assert cli_main(["cache", "verify", "--disk-cache-dir", str(disk)]) == 0  # quarantined
    capsys.readouterr()
    assert cli_main(["cache", "clear", "--disk-cache-dir", str(disk)]) == 0
    capsys.readouterr()
    assert not list(disk.glob("??/*.kv"))
