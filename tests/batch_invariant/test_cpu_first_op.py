"""A CPU op's bits must not depend on whether it is the first parallel op of its process.

torch's first parallel CPU op of a process can split a small elementwise op across its intra-op
threads where every later call of it runs on one, and the second thread's share then came out
1 ulp apart (zmrl/batch_invariant/_cpu_threads.py). Importing zmrl.batch_invariant settles the
threads first. Each probe is a fresh process: exp over a [64, 300] tensor, first call against the
second.

No negative control is asserted: without the import the first call differed in about a third of
fresh processes on this VM when run alone (docs/benchmarks.md), but in none of 24 inside one
fresh-clone CI run, so such a control would fail by chance. With the settle removed, 12 probes
here would all agree by chance about 1 time in 100."""
import subprocess
import sys

_PROBE = r"""
import sys, torch
if sys.argv[1] == "zmrl":
    import zmrl.batch_invariant  # noqa: F401
x = torch.randn(64, 300, generator=torch.Generator().manual_seed(0)) * 3
first, second = torch.exp(x), torch.exp(x)
print(int((first != second).sum()))
"""


def _differing_elements(mode: str, processes: int) -> list[int]:
    counts = []
    for _ in range(processes):
        done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        counts.append(int(done.stdout.split()[-1]))
    return counts


def test_the_first_op_of_a_process_gives_the_bits_of_later_calls():
    assert _differing_elements("zmrl", 12) == [0] * 12
