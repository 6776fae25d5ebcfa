"""The README's result tables are the benchmarks' results files, number for number.

The benchmarks write what they print to `benchmarks/results/*.json` (`--results`); this
test renders each README row and figure from those files and finds it in the README, so a
table typed by hand, or left behind by a new run, fails here. Nothing is timed.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = (ROOT / "README.md").read_text()
FLAT = " ".join(README.split())

# which command's file each row of the first table comes from, as the README says
# ("the ddp, zero3 and fsdp2 rows from the first command, the zero1 and zero2 rows from
# the second")
FIRST_TABLE = {"ddp": "pytorch-1mb-buckets", "zero3": "pytorch-1mb-buckets",
               "fsdp2": "pytorch-1mb-buckets", "zero1": "pytorch", "zero2": "pytorch"}


def results(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def table_rows(header_start: str) -> list[list[str]]:
    """The cells of the markdown table whose header row starts with `header_start`."""
    lines = README.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def strategy(cell: str) -> str:
    return re.match(r"`([^`]+)`", cell).group(1)


def test_every_results_file_names_its_command_and_source():
    for path in RESULTS.glob("*.json"):
        data = json.loads(path.read_text())
        assert data["command"].startswith("python benchmarks/")
        assert f"--results benchmarks/results/{path.name}" in data["command"]
        assert data["source"]
        # the README lists the command that produced the file
        command = data["command"].replace("python ", "", 1).split(" --results")[0]
        assert all(word in FLAT for word in command.split()), path.name


def test_the_table_against_pytorch():
    rows = table_rows("| ours | PyTorch's |")
    assert {strategy(r[0]) for r in rows} == set(FIRST_TABLE)
    for ours_cell, theirs_cell, numbers in rows:
        ours, theirs = strategy(ours_cell), strategy(theirs_cell)
        data = results(FIRST_TABLE[ours])["rows"]
        assert data[ours]["reference"] == theirs
        expected = (f"{data[ours]['step_ms']:.1f} / {data[theirs]['step_ms']:.1f} ms "
                    f"(**{data[ours]['ratio']:.2f}**)")
        assert numbers == expected, ours


def test_the_small_buckets_figures_in_the_prose():
    data = results("pytorch-1mb-buckets")["rows"]
    z1, z2 = data["zero1"], data["zero2"]
    assert (f"they then take {z1['step_ms']:.1f} and {z2['step_ms']:.1f} ms, "
            f"{z1['ratio']:.2f} × and {z2['ratio']:.2f} × their references") in FLAT


def test_the_table_beside_deepspeed():
    data = results("deepspeed")["rows"]
    rows = table_rows("| ours | DeepSpeed's |")
    assert len(rows) == 3
    for ours_cell, theirs_cell, step, optim, sent in rows:
        ours, theirs = strategy(ours_cell), strategy(theirs_cell)
        a, b = data[ours], data[theirs]
        assert a["reference"] == theirs
        assert step == f"{a['step_ms']:.1f} / {b['step_ms']:.1f} ms (**{a['ratio']:.2f}**)"
        assert optim == f"{a['optimizer_mib']:.2f} / {b['optimizer_mib']:.2f}"
        assert sent == f"{a['sent_mib_per_step']:.2f} / {b['sent_mib_per_step']:.2f}"
    assert f"(the {data['deepspeed-zero3']['grads_mib']:.2f} MiB of gradients" in FLAT


def test_the_overlap_table_and_its_prose():
    data = results("overlap")["rows"]
    rows = table_rows("| strategy | 2 ranks: on / off |")
    assert {strategy(r[0]) for r in rows} == {"zero1", "zero2"}

    def cell(r):
        return (f"{r['on_ms']:.1f} / {r['off_ms']:.1f} ms (**{r['ratio']:.2f}**, "
                f"{r['ratio_min']:.2f}–{r['ratio_max']:.2f})")
    for name_cell, two, four in rows:
        s = strategy(name_cell)
        assert (two, four) == (cell(data["2"][s]), cell(data["4"][s])), s
    z2 = {w: data[w]["zero2"] for w in ("2", "4")}
    assert (f"falls from {z2['2']['exposed_off_ms']:.1f} to {z2['2']['exposed_on_ms']:.1f} ms "
            f"on 2 ranks and from {z2['4']['exposed_off_ms']:.1f} to "
            f"{z2['4']['exposed_on_ms']:.1f} ms on 4") in FLAT
    gains = [round(100 * (1 - r["ratio"])) for w in data.values() for r in w.values()]
    assert f"by {min(gains)}–{max(gains)}%" in FLAT


def test_a_changed_result_fails(monkeypatch):
    """The check can fail: one number changed in a results file is caught."""
    original = results

    def altered(name):
        data = original(name)
        if name == "pytorch":
            data["rows"]["zero1"]["step_ms"] += 0.1
        return data
    monkeypatch.setitem(globals(), "results", altered)
    with pytest.raises(AssertionError):
        test_the_table_against_pytorch()


def test_the_step_time_table():
    """The median error of the step-time model per strategy and world, and the term the
    benchmark most often names, as `bench_steptime.py --results` wrote them."""
    data = results("steptime")
    rows = table_rows("| strategy | median error, 2 ranks |")
    assert {strategy(r[0]) for r in rows} == set(data["median_error"])
    for name_cell, two, four, term in rows:
        name = strategy(name_cell)
        errors = data["median_error"][name]
        assert two == f"{100 * errors['2']:.0f}%" and four == f"{100 * errors['4']:.0f}%"
        named = [r["term_off"].split(" off")[0] for r in data["rows"]
                 if r["strategy"] == name and r["term_off"]]
        expected = max(sorted(set(named)), key=named.count) if named else "none"
        assert term == expected, name


def test_the_zero_infinity_table_is_its_results_file():
    r = results("infinity")
    names = {"`zero3`, in memory": "zero3", "`zero3`, states on disk": "zero3 + disk",
             "`deepspeed-zero3`, nvme": "deepspeed-zero3 + nvme"}
    rows = table_rows("| run | step (median, min–max)")
    assert [cells[0] for cells in rows] == list(names)
    for cells in rows:
        row = r["rows"][names[cells[0]]]
        cells[2] = cells[2].strip("*")  # the two disk tiers' ratios are in bold
        assert cells[1:] == [
            f"{row['step_ms']:.1f} ms ({row['min_ms']:.0f}–{row['max_ms']:.0f})",
            f"{row['ratio']:.2f}",
            f"{row['read_mib_per_step']:.1f} / {row['written_mib_per_step']:.1f} MiB",
            f"{row['peak_mib']:.1f} MiB"], cells
    model = r["model"]
    for text in (r["command"], f"{model['bandwidth_mb_s']['read']:,} MB/s",
                 f"{model['bandwidth_mb_s']['write']:,} MB/s",
                 f"predicted our step at {model['predicted_step_ms']} ms (efficiency "
                 f"{model['predicted_efficiency']} against {model['measured_efficiency']} "
                 f"measured"):
        assert text in FLAT, text
    assert {row["max_loss_diff"] for row in r["rows"].values()} == {0.0}
