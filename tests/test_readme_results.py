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

# the file of each bucket size in the tables against PyTorch and DeepSpeed, as the README
# names the commands that wrote them
BUCKETS = {"2²⁰ elements": "1m-buckets", "25 MB": "25m-buckets"}


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


def rows_against(against: str) -> dict[tuple[str, str, str], dict]:
    """(ours, ranks, buckets) -> the results row, for every strategy of the course that
    the files compare with a reference of `against` ("pytorch" or "deepspeed")."""
    out = {}
    for buckets, suffix in BUCKETS.items():
        for world, table in results(f"{against}-{suffix}")["worlds"].items():
            for name, row in table["rows"].items():
                if row["reference"] is not None:
                    out[name, world, buckets] = {**row, "theirs": table["rows"][row["reference"]]}
    return out


def test_the_table_against_pytorch():
    expected = rows_against("pytorch")
    rows = table_rows("| ours | PyTorch's | ranks | buckets |")
    assert {(strategy(r[0]), r[2], r[3]) for r in rows} == set(expected)
    for ours_cell, theirs_cell, ranks, buckets, numbers in rows:
        row = expected[strategy(ours_cell), ranks, buckets]
        assert row["reference"] == strategy(theirs_cell)
        assert numbers == (f"{row['step_ms']:.1f} / {row['theirs']['step_ms']:.1f} ms "
                           f"(**{row['ratio']:.2f}**)"), (ours_cell, ranks, buckets)


def test_the_table_beside_deepspeed():
    expected = rows_against("deepspeed")
    rows = table_rows("| ours | DeepSpeed's | ranks | buckets |")
    assert {(strategy(r[0]), r[2], r[3]) for r in rows} == set(expected)
    for ours_cell, theirs_cell, ranks, buckets, step, optim, sent in rows:
        a = expected[strategy(ours_cell), ranks, buckets]
        b = a["theirs"]
        assert a["reference"] == strategy(theirs_cell)
        assert step == f"{a['step_ms']:.1f} / {b['step_ms']:.1f} ms (**{a['ratio']:.2f}**)"
        assert optim == f"{a['optimizer_mib']:.2f} / {b['optimizer_mib']:.2f}"
        assert sent == f"{a['sent_mib_per_step']:.2f} / {b['sent_mib_per_step']:.2f}"
    big = results("deepspeed-25m-buckets")["worlds"]["4"]["rows"]
    assert f"(the {big['deepspeed-zero3']['grads_mib']:.2f} MiB of gradients" in FLAT


def test_the_load_beside_the_tables():
    """The machine's load while the tables were measured, as the files recorded it."""
    for against in ("pytorch", "deepspeed", "same-ranks", "same-ranks-deepspeed"):
        for suffix in BUCKETS.values():
            load = results(f"{against}-{suffix}")["setup"]["load_average"]
            assert f"{load['start'][0]:.2f} to {load['end'][0]:.2f}" in FLAT, (against, suffix)


@pytest.mark.parametrize("against", ["pytorch", "deepspeed"])
def test_the_tables_in_the_same_ranks(against):
    """`bench_same_ranks.py`'s rows, and what the prose says of their losses: exactly equal
    on 2 ranks, within 10^-4 on 4."""
    expected = rows_against("same-ranks" if against == "pytorch" else "same-ranks-deepspeed")
    whose = "PyTorch's" if against == "pytorch" else "DeepSpeed's"
    rows = table_rows(f"| ours | {whose} | ranks | buckets | step: ours / theirs |")
    assert {(strategy(r[0]), r[2], r[3]) for r in rows} == set(expected)
    for ours_cell, theirs_cell, ranks, buckets, step, ratio, cpu, cpu_ratio, loss_diff in rows:
        row = expected[strategy(ours_cell), ranks, buckets]
        assert row["reference"] == strategy(theirs_cell)
        assert step == f"{row['step_ms']:.1f} / {row['theirs']['step_ms']:.1f} ms"
        assert ratio == f"**{row['ratio']:.2f}** ({row['ratio_q1']:.2f}–{row['ratio_q3']:.2f})"
        assert cpu == f"{row['cpu_ms']:.1f} / {row['theirs']['cpu_ms']:.1f} ms"
        assert cpu_ratio == (f"**{row['cpu_ratio']:.2f}** ({row['cpu_ratio_q1']:.2f}–"
                             f"{row['cpu_ratio_q3']:.2f})")
        assert loss_diff == f"{row['loss_diff']:.1e}"
    assert all(row["loss_diff"] == 0 for (_, ranks, _), row in expected.items() if ranks == "2")
    if against == "deepspeed":  # "every row is below 1 and so is every upper quartile"
        assert all(r["ratio"] < 1 and r["ratio_q3"] < 1 for r in expected.values())
        # "In CPU time every row is below 1 too", and the closest named
        assert all(r["cpu_ratio"] < 1 for r in expected.values())
        closest = max(expected.items(), key=lambda kv: kv[1]["cpu_ratio"])
        (name, ranks, buckets), row = closest
        assert (f"`{name}` on {ranks} ranks with {buckets.replace(' elements', '-element')} "
                f"buckets the closest ({row['cpu_ratio']:.2f}, quartiles "
                f"{row['cpu_ratio_q1']:.2f}–{row['cpu_ratio_q3']:.2f})") in FLAT
        zero2 = [f"{expected['zero2', w, '2²⁰ elements']['ratio']:.2f}" for w in ("2", "4")]
        assert "`zero2` is at {} and {} on 2 and 4 ranks with 2²⁰-element buckets".format(
            *zero2) in FLAT
        return
    launches = rows_against("pytorch")
    inside = sum(launches[key]["ratio_min"] <= row["ratio"] <= launches[key]["ratio_max"]
                 for key, row in expected.items())
    assert f"{inside} of the {len(expected)} ratios here inside the range" in FLAT
    sharded = [r for rows in (expected, launches) for (name, _, _), r in rows.items()
               if name != "ddp"]
    assert ("every sharded row below 1 in both" in FLAT) == all(r["ratio"] < 1 for r in sharded)
    assert ("In CPU time every row here is below 1, `ddp`'s the closest" in FLAT) == (
        all(r["cpu_ratio"] < 1 for r in expected.values())
        and max(expected, key=lambda k: expected[k]["cpu_ratio"])[0] == "ddp")
    assert all(row["loss_diff"] < 1e-4 for row in expected.values())


def test_what_the_prose_says_of_ddp_against_torch_ddp():
    """The figures the paragraph on `ddp` quotes, from the files of both benchmarks; and it
    says "not reliably below" only while some row is above 1."""
    launches = {(w, b): r for (name, w, b), r in rows_against("pytorch").items() if name == "ddp"}
    same = {(w, b): r for (name, w, b), r in rows_against("same-ranks").items() if name == "ddp"}
    small, big = BUCKETS
    for rows, sentence in (
            (launches, "`ddp` at {} on 2 ranks and {} on 4 with 2²⁰-element buckets, {} and {} "
                       "with 25 MB"),
            (same, "there `ddp` is at {} and {} with 2²⁰-element buckets and {} and {} with 25 "
                   "MB")):
        figures = [f"{rows[w, b]['ratio']:.2f}" for b in (small, big) for w in ("2", "4")]
        assert sentence.format(*figures) in FLAT, sentence
    spreads = [r["max_ms"] / r["min_ms"] - 1 for suffix in BUCKETS.values()
               for table in results(f"pytorch-{suffix}")["worlds"].values()
               for r in table["rows"].values()]
    assert f"repetitions in the tables above lie {100 * min(spreads):.0f}–{100 * max(spreads):.0f}% apart" \
        in FLAT
    least = min(r["ratio_min"] for r in launches.values())
    most = max(r["ratio_max"] for r in launches.values())
    assert f"anywhere from {least:.2f} to {most:.2f}" in FLAT
    same_files = [results(f"{kind}-{suffix}") for kind in ("same-ranks", "same-ranks-deepspeed")
                  for suffix in BUCKETS.values()]
    busy = [r["cpu_ms"] / data["setup"]["cores"] / r["step_ms"] for data in same_files
            for table in data["worlds"].values() for r in table["rows"].values()]
    assert (f"its CPU time over the cores is {100 * min(busy):.0f}–{100 * max(busy):.0f}% of its "
            f"wall time in every row of the same-ranks tables") in FLAT
    above = any(r["ratio"] > 1 for r in [*launches.values(), *same.values()])
    assert ("`ddp` is not reliably below `torch-ddp`" in FLAT) == above
    # the work: CPU time in the same ranks, and "no more work ... in any row" only while true
    cpu = [f"{same[w, b]['cpu_ratio']:.2f}" for b in (small, big) for w in ("2", "4")]
    assert "and its CPU time at {} and {}, {} and {}".format(*cpu) in FLAT
    assert ("no more work than PyTorch's DDP in any row" in FLAT) == all(
        r["cpu_ratio"] <= 1 for r in same.values())


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
    assert (f"from {z2['2']['exposed_off_ms']:.1f} to {z2['2']['exposed_on_ms']:.1f} ms on 2 "
            f"ranks") in FLAT
    assert f"from {z2['4']['exposed_off_ms']:.1f} to {z2['4']['exposed_on_ms']:.1f} ms on 4" in FLAT
    # the prose says which way the overlap went on 4 ranks, as the repetitions did
    if all(r["ratio_min"] > 1 for r in data["4"].values()):
        assert "slower on 4, in every\nrepetition".replace("\n", " ") in FLAT


def test_the_gradient_collective_table():
    """ZeRO-1/2's gradients all-reduced against reduce-scattered, in one launch per world
    (`bench_overlap.py --vary gradient_collective`), as its results file has them."""
    data = results("gradient-collective")
    assert data["setup"]["varied"] == "gradient_collective"
    rows = table_rows("| strategy | 2 ranks: all-reduce / reduce-scatter |")
    assert {strategy(r[0]) for r in rows} == {"zero1", "zero2"}
    for name_cell, two, four in rows:
        s = strategy(name_cell)
        for cell, r in ((two, data["rows"]["2"][s]), (four, data["rows"]["4"][s])):
            assert cell == (f"{r['on_ms']:.1f} / {r['off_ms']:.1f} ms (**{r['ratio']:.2f}**, "
                            f"{r['ratio_min']:.2f}–{r['ratio_max']:.2f})"), s
    # the prose says what every row shows, only while every row shows it
    every = [r for world in data["rows"].values() for r in world.values()]
    said = ("median step is at or below the reduce-scatter's in every row" in FLAT,
            "is lower with it in every row" in FLAT)
    assert said == (all(r["ratio"] <= 1 for r in every),
                    all(r["exposed_on_ms"] < r["exposed_off_ms"] for r in every))


def test_a_changed_result_fails(monkeypatch):
    """The check can fail: one number changed in a results file is caught."""
    original = results

    def altered(name):
        data = original(name)
        if name == "pytorch-1m-buckets":
            data["worlds"]["4"]["rows"]["zero1"]["step_ms"] += 0.1
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
    for name_cell, two, four, spread_two, spread_four, term in rows:
        name = strategy(name_cell)
        errors = data["median_error"][name]
        assert two == f"{100 * errors['2']:.0f}%" and four == f"{100 * errors['4']:.0f}%"
        for cell, (least, most) in ((spread_two, data["median_error_spread"][name]["2"]),
                                    (spread_four, data["median_error_spread"][name]["4"])):
            assert cell == f"{100 * least:.0f}–{100 * most:.0f}%", name
        named = [r["term_off"].split(" off")[0] for r in data["rows"]
                 if r["strategy"] == name and r["term_off"]]
        expected = max(sorted(set(named)), key=named.count) if named else "none"
        assert term == expected, name


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _listed(values: list[str]) -> str:
    return ", ".join(values[:-1]) + " and " + values[-1]


def test_the_step_time_prose():
    """Every figure the step-time section's prose quotes, rendered from the same results
    file as its table: a new run that leaves one sentence behind fails here."""
    import statistics
    data = results("steptime")
    rows, machines = data["rows"], data["machines"]

    def error(rs, key="step_ratio"):
        return _pct(statistics.median(abs(r[key] - 1) for r in rs))
    world = {w: [r for r in rows if r["world"] == w] for w in (2, 4)}
    llama = {w: [r for r in world[w] if r["model"] == "hf-llama"] for w in (2, 4)}
    load = data["load_average"]
    expected = [
        f"the load average, {load['start'][0]:.1f} at its start and {load['end'][0]:.1f} at "
        f"its end",
        f"Over all runs the median error is {error(rows)} ({error(world[2])} on 2 ranks, "
        f"{error(world[4])} on 4)",
        f"misses by {error(rows, 'plain_ratio')} ({error(world[2], 'plain_ratio')}, "
        f"{error(world[4], 'plain_ratio')})",
        f"The held-out Llama alone: {error(llama[2])} on 2 ranks and {error(llama[4])} on 4, "
        f"against {error(llama[2], 'plain_ratio')} and {error(llama[4], 'plain_ratio')} plain",
    ]
    medians = {(s, w): e for s, per in data["median_error"].items() for w, e in per.items()}
    within = sum(e <= 0.2 for e in medians.values())
    expected.append(f"{within} of the {len(medians)} medians are")
    expected += [f"`{s}` on {w}" for (s, w), e in medians.items() if e > 0.2]
    expected += [f"({_pct(e)})" for e in medians.values() if e > 0.2]
    spreads = [hi - lo for per in data["median_error_spread"].values() for lo, hi in per.values()]
    expected.append(f"medians lie {100 * min(spreads):.0f} to {100 * max(spreads):.0f} points "
                    f"apart")
    flops = [m["gpt-tiny"]["flops"] / 1e9 for m in machines["4"]]
    expected.append(f"between {min(flops):.1f} and {max(flops):.1f} GFLOP/s per rank")
    for w in ("2", "4"):
        etas = [f"{m['gpt-tiny']['hiding']:.2f}" for m in machines[w]]
        expected.append(f"on {w} ranks {_listed(etas)}")
        fixed = [m["gpt-tiny"]["in_step"]["all_reduce"]["fixed"] * 1e3 for m in machines[w]]
        expected.append(f"from {min(fixed):.1f} to {max(fixed):.1f} ms on {w}")
    largest = max(medians, key=medians.get)
    expected.append(f"the largest `{largest[0]}` on {largest[1]} ranks ({_pct(medians[largest])})")
    for w in ("2", "4"):
        loop = [m["gpt-tiny"]["loop_seconds"] * 1e3 for m in machines[w]]
        expected.append(f"from {min(loop):.2f} to {max(loop):.2f} ms")
    ledger = [m["gpt-tiny"]["ledger_seconds"] * 1e3 for ms in machines.values() for m in ms]
    expected.append(f"from {min(ledger):.2f} to {max(ledger):.2f} ms (each rank")
    unit = [m["gpt-tiny"]["unit_work"][s] * 1e3 for m in machines["4"] for s in ("zero3", "fsdp2")]
    if max(unit) < 0:
        expected.append(f"in every repetition (down to −{-min(unit):.1f} ms)")
    missing = [sentence for sentence in expected if " ".join(sentence.split()) not in FLAT]
    assert not missing, missing


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
