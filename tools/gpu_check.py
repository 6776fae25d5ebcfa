"""The course's GPU checks in one command, in at most 8 minutes, into one JSON file.

    PYTHONPATH=code python tools/gpu_check.py --out gpu-check.json      # on a GPU
    PYTHONPATH=code python tools/gpu_check.py --dry-run --out dry.json  # on a CPU, in CI

A GPU is lent only sometimes, and briefly: this runs from a plain copy of the repository,
installs nothing, and needs no network. It runs each item (`gpu_check_items.ITEMS`) in a
process of its own, in order, with a time limit of its own inside one global budget; an
item that no longer fits is recorded as "skipped: out of time", one that fails or runs out
of time is recorded with the last line of its error (and what it measured before), and the
next one runs. The results file is written again after every item, so a run killed from
outside still leaves what it measured. Each item's output goes to a log beside it.

Committed as `code/shardlab/data/gpu-check.json`, the file is what the course's GPU
sections show (`shardlab.gpu_record`). `--dry-run` runs every item small, on the CPU
over gloo (every code path but CUDA's): `tests/test_gpu_check.py` runs it, so the check
cannot rot between GPU runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COURSE_RECORD = ROOT / "code" / "shardlab" / "data" / "gpu-check.json"
BUDGET = 480.0   # seconds for the whole check: 8 minutes
GRACE = 20.0     # seconds an item may run past its deadline before it is stopped


@dataclass(frozen=True)
class Item:
    name: str
    seconds: float        # its time limit on a GPU, within the budget
    dry_seconds: float    # and in the dry run
    least: float = 10.0   # not started with less than this left


# In the order they run: the cheap facts first, then what the last GPU run found broken.
# Each item's limit is also what the budget leaves once the items after it have the least
# they need: an item that ends early leaves its time to the next ones.
# On a GPU the limits add up to the budget, less what env and matmul leave unused.
ITEMS = [Item("env", 30, 30), Item("matmul", 40, 30),
         Item("strategies", 120, 90, least=40), Item("pytest_cuda", 100, 60, least=40),
         Item("memory", 110, 60, least=40), Item("overlap", 50, 40, least=25),
         Item("step_ratios", 70, 60, least=30)]


def run_command(command: list[str], timeout: float, log: Path, cwd: Path = ROOT,
                env: dict | None = None) -> tuple[int | None, float]:
    """Run `command` in a session of its own, its output appended to `log`; stop it and
    everything it started when `timeout` seconds have passed. Returns (exit status, or
    None if it was stopped; seconds)."""
    start = time.monotonic()
    with log.open("ab") as out:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return process.wait(timeout=max(0.1, timeout)), time.monotonic() - start
        except subprocess.TimeoutExpired:
            for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, None)):
                try:
                    os.killpg(process.pid, sig)  # the item's own session: its ranks too
                except ProcessLookupError:
                    break
                try:
                    process.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            process.wait()
            return None, time.monotonic() - start


def write_json(path: Path, data: dict) -> None:
    """Replace `path` in one step: a reader (or a kill) never meets half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def last_line(text: str) -> str | None:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else None


def run_item(item: Item, timeout: float, dry_run: bool, log: Path) -> dict:
    """One item in a process of its own (`--item`): its status, seconds, error line and
    result (partial when it failed or ran out of time)."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        answer = Path(tmp) / "item.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--item", item.name,
                   "--item-out", str(answer), "--deadline", str(time.time() + timeout)]
        env = dict(os.environ)  # the package from this checkout, with or without PYTHONPATH
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "code"),
                                                          env.get("PYTHONPATH")]))
        with log.open("a") as f:
            f.write(f"\n===== {item.name} =====\n")
        returncode, seconds = run_command(command + (["--dry-run"] if dry_run else []),
                                          timeout + GRACE, log, env=env)
        reply = json.loads(answer.read_text()) if answer.exists() else {}
    entry = {"seconds": round(seconds, 1), "result": reply.get("result"),
             "error": reply.get("error")}
    if returncode is None:
        entry.update(status=f"timed out after {timeout + GRACE:.0f} s")
    elif returncode == 0 and reply.get("complete"):
        entry.update(status="ok")
    else:
        entry.update(status="failed")
        entry["error"] = entry["error"] or last_line(log.read_text(errors="replace")) \
            or f"exit status {returncode}"
    return entry


def head_commit() -> str | None:
    """The checkout's commit, or None: a plain copy of the repository may have no .git,
    a machine no git."""
    try:
        git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=False, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return git.stdout.strip() if git.returncode == 0 else None


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_check(out: Path, budget: float, dry_run: bool, names: list[str],
              merge: bool = False) -> dict:
    """Run the items `names`, in ITEMS' order, into the record at `out`. `merge`: keep
    the record already there and run these items again into it (their log appended)."""
    start = time.time()
    # an item may overrun its limit by GRACE, and stopping it takes seconds more: the
    # last item's limit ends that much before the budget does
    deadline = start + budget - GRACE - 10
    log = out.with_suffix(".log")
    command = " ".join(["python", "tools/gpu_check.py", *sys.argv[1:]])
    if merge and out.exists():
        record = json.loads(out.read_text())
        if record.get("dry_run") != dry_run:
            raise SystemExit(f"{out} holds a {'dry' if record.get('dry_run') else 'GPU'} "
                             f"run: give another --out to keep both")
        record.setdefault("reruns", []).append({"items": names, "started": now_utc(),
                                                "command": command, "commit": head_commit()})
    else:
        log.write_text("")
        record = {"format": 1, "dry_run": dry_run, "command": command, "started": now_utc(),
                  "finished": None, "budget_seconds": budget, "device": {}, "items": {}}
    record["items"].update({name: {"status": "pending"} for name in names})
    write_json(out, record)
    chosen = [i for i in ITEMS if i.name in names]
    for n, item in enumerate(chosen):
        left = deadline - time.time()
        later = sum(i.least for i in chosen[n + 1:])
        limit = min(item.dry_seconds if dry_run else item.seconds, max(item.least, left - later))
        limit = min(limit, left)
        if left < item.least:
            entry = {"status": "skipped: out of time", "seconds": 0, "result": None,
                     "error": None}
        else:
            print(f"[gpu-check] {item.name}: up to {limit:.0f} s ...", flush=True)
            entry = run_item(item, limit, dry_run, log)
        record["items"][item.name] = entry
        if item.name == "env" and entry["result"]:
            record["device"] = entry["result"]
        write_json(out, record)
        print(f"[gpu-check] {item.name}: {entry['status']} ({entry['seconds']} s)"
              + (f": {entry['error']}" if entry.get("error") else ""), flush=True)
    record["finished"] = now_utc()
    write_json(out, record)
    return record


def item_main(name: str, answer: Path, deadline: float, dry_run: bool) -> int:
    """In an item's own process: measure, saving partial results as they come."""
    import gpu_check_items as items

    last: dict = {"result": None, "complete": False}

    def save(result, complete: bool = False) -> None:
        last.update(result=result, complete=complete)
        write_json(answer, last)

    try:
        save(items.ITEMS[name](items.DRY if dry_run else items.GPU, deadline, save), True)
        return 0
    except BaseException as exc:  # noqa: BLE001 - an item's failure is recorded, not raised
        traceback.print_exc()
        write_json(answer, {**last, "complete": False,
                            "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500]})
        return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help=f"the results file (default: {COURSE_RECORD.relative_to(ROOT)}, the "
                        f"one the course reads; for --dry-run, one in a temporary folder)")
    p.add_argument("--dry-run", action="store_true",
                   help="every item small, on the CPU over gloo: every code path but CUDA's")
    p.add_argument("--budget", type=float, default=BUDGET,
                   help=f"seconds for the whole check (default {BUDGET:.0f})")
    p.add_argument("--items", nargs="+", choices=[i.name for i in ITEMS],
                   help="run only these items, into the results file if it is there "
                        "(the other items' results are kept)")
    p.add_argument("--item", help=argparse.SUPPRESS)
    p.add_argument("--item-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.item:
        return item_main(args.item, args.item_out, args.deadline, args.dry_run)
    if args.budget <= 0:
        p.error(f"--budget must be a number of seconds > 0, got {args.budget:g}")
    if not args.dry_run:
        import torch
        if not torch.cuda.is_available():
            p.error("no CUDA GPU here: run with --dry-run to check the script on the CPU")
    out = args.out or (Path(tempfile.mkdtemp(prefix="gpu-check-")) / "gpu-check.json"
                       if args.dry_run else COURSE_RECORD)
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    record = run_check(out, args.budget, args.dry_run,
                       args.items or [i.name for i in ITEMS], merge=bool(args.items))
    failed = [n for n, e in record["items"].items() if e["status"] != "ok"]
    print(f"[gpu-check] {len(record['items']) - len(failed)} of {len(record['items'])} items "
          f"ok" + (f"; not ok: {', '.join(failed)}" if failed else ""))
    print(f"[gpu-check] results: {out}")
    print(f"[gpu-check] log: {out.with_suffix('.log')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
