"""``kvq eval frontier``: joining ppl and niah results by label, the seed groups folded, the goal column."""
from __future__ import annotations

import pytest

from kvq_core.tools.eval.frontier import format_table, meets_goal, merge, rows

GOAL = {"bits": 2.5, "ppl": 5.0, "kl": 0.05, "recall": 0.05}


def _ppl(labels: dict[str, tuple[str, float, float, float]], windows=(0, 1)) -> dict:
    """A ppl result: label -> (kind, true bits, delta %, kl)."""
    return {"protocol": {"windows": list(windows), "prefix": 96, "score": 32}, "model": {"name": "m"}, "text": "t",
            "configs": [{"label": k, "kind": v[0], "bits": 2} for k, v in labels.items()],
            "summary": [{"label": k, "windows": 2, "bits_per_element": v[1], "ppl": 10 * (1 + v[2] / 100), "delta_pct": v[2], "kl": v[3]}
                        for k, v in labels.items()], "groups": []}


def _niah(hits: dict[str, list[bool]]) -> dict:
    runs = [{"label": k, "task": task, "context": 2048, "correct": h} for k, hs in hits.items() for h in hs
            for task in ("passkey", "multikey")]
    return {"protocol": {"tasks": ["passkey", "multikey"], "depths": [0.5], "trials": 1, "seed": 1, "haystack": "t"},
            "runs": runs}


def test_rows_join_recall_and_judge_the_goal() -> None:
    ppl = _ppl({"fp": ("fp", 16.0, 0.0, 0.0), "a": ("kvq", 2.4, 4.0, 0.04), "b": ("plan", 2.4, 6.0, 0.04)})
    niah = _niah({"fp": [True, True, False, True], "a": [True, True, False, True], "b": [True, False, False, False]})
    table = {r["label"]: r for r in rows(ppl, niah, 2048)}
    assert table["a"]["recall"] == pytest.approx(0.75) and table["a"]["passkey_n"] == 4
    assert meets_goal(table["a"], table["fp"]["recall"], GOAL) is True
    assert meets_goal(table["b"], table["fp"]["recall"], GOAL) is False  # Δ PPL over 5% and recall 0.5 below fp
    text = format_table(list(table.values()), GOAL, 2048)
    assert "| a | kvq | 2.40 |" in text and "tuned plan" in text and "| 0.75 | 2 | yes |" in text


def test_merge_keeps_a_labels_first_run_and_refuses_other_windows() -> None:
    one = _ppl({"fp": ("fp", 16.0, 0.0, 0.0), "a": ("kvq", 3.0, 1.0, 0.01)})
    two = _ppl({"fp": ("fp", 16.0, 0.0, 0.0), "b": ("plan", 2.5, 2.0, 0.02)})
    joined = merge([one, two], "summary")
    assert [r["label"] for r in joined["summary"]] == ["fp", "a", "b"]
    with pytest.raises(ValueError, match="windows differ"):
        merge([one, _ppl({"c": ("kvq", 2.0, 1.0, 0.1)}, windows=(5,))], "summary")


def test_seed_copies_fold_into_their_group_and_take_the_groups_recall() -> None:
    ppl = _ppl({"fp": ("fp", 16.0, 0.0, 0.0), "a@seed0": ("kvq", 2.4, 4.0, 0.04), "a@seed1": ("kvq", 2.4, 8.0, 0.06)})
    for r in ppl["summary"][1:]:
        r["group"] = "a"
    ppl["groups"] = [{"group": "a", "delta_sd": 2.83}]
    for c in ppl["configs"][1:]:
        c["group"] = "a"
    niah = _niah({"fp": [True, True], "a": [True, False]})  # a recall run without --seeds names the group
    table = {r["label"]: r for r in rows(merge([ppl], "summary"), niah, 2048)}
    assert table["a"]["delta_sd"] == 2.83  # the seed group's spread survives the merge
    assert set(table) == {"fp", "a"} and table["a"]["seeds"] == 2
    assert table["a"]["delta_pct"] == pytest.approx(6.0) and table["a"]["kl"] == pytest.approx(0.05)
    assert table["a"]["recall"] == pytest.approx(0.5) and table["a"]["passkey_n"] == 2


def test_a_folder_of_results_under_other_names_gets_no_empty_summary(tmp_path) -> None:
    """``kvq eval ... --out folder/ppl.json`` (the frontier's inputs): no eval_summary.md with an
    empty table and links to files that are not there."""
    import json

    from kvq_core.tools.eval.report import SUMMARY_MD, write_summary

    (tmp_path / "ppl.json").write_text(json.dumps(_ppl({"fp": ("fp", 16.0, 0.0, 0.0)})))
    assert write_summary(tmp_path) is None and not (tmp_path / SUMMARY_MD).exists()
