"""Where `make test`'s time goes: the slowest tests, the slowest modules, and how busy the workers were.

`make test` writes pytest's JUnit XML to ``tests/_artifacts/junit.xml`` (each test's time is its setup, call and
teardown, so a module fixture's build lands on the module's first test). This reads it and prints:

* the sum of all tests' times against the run's wall time: with W workers, sum / (W × wall) is how busy they were;
* the N slowest tests, with what each loads (the ``loads`` property tests/conftest.py records: the fixtures that
  build a model, an engine, a server or a venv, and the slow/browser/gpu marks);
* the slowest modules (sum of their tests' times) and their share of the sum.

    python bench/suite_profile.py [tests/_artifacts/junit.xml] [--top 30] [--workers 2]

Numbers depend on the machine and on what else ran beside the suite; quote them with the commit and the load.
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET
from pathlib import Path


def read(path: Path) -> tuple[float, list[tuple[str, float, str]]]:
    """``(wall_s, [(test id, seconds, loads), ...])`` from a pytest JUnit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    wall = sum(float(s.get("time", 0.0)) for s in suites)
    tests = []
    for case in root.iter("testcase"):
        loads = next((p.get("value", "") for p in case.iter("property") if p.get("name") == "loads"), "")
        tests.append((f"{case.get('classname', '')}::{case.get('name', '')}", float(case.get("time", 0.0)), loads))
    return wall, tests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", nargs="?", default="tests/_artifacts/junit.xml", type=Path)
    parser.add_argument("--top", type=int, default=30, help="how many tests and modules to list")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers of the run (make test: cores)")
    args = parser.parse_args()
    wall, tests = read(args.junit)
    total = sum(t for _, t, _ in tests)
    print(f"{len(tests)} tests, sum of their times {total / 60:.1f} min, wall {wall / 60:.1f} min "
          f"({args.workers} workers busy {total / max(wall * args.workers, 1e-9):.0%} of the wall time)")
    print(f"\nslowest {args.top} tests (s, what they load):")
    for name, secs, loads in sorted(tests, key=lambda t: -t[1])[:args.top]:
        print(f"{secs:8.1f}  {name}" + (f"  [{loads}]" if loads else ""))
    modules: dict[str, list[float]] = collections.defaultdict(list)
    for name, secs, _ in tests:
        modules[name.split("::", 1)[0]].append(secs)
    print(f"\nslowest {args.top} modules (s, tests, share of the sum):")
    for module, times in sorted(modules.items(), key=lambda m: -sum(m[1]))[:args.top]:
        print(f"{sum(times):8.1f}  {len(times):4d}  {sum(times) / max(total, 1e-9):5.1%}  {module}")


if __name__ == "__main__":
    main()
