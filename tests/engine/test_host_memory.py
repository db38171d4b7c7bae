"""The CPU engine's malloc settings: a step's freed activations are reused without new page faults."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CYCLES = textwrap.dedent("""
    import resource, sys, torch
    from apcscore.engine.host_memory import keep_freed_memory
    applied = keep_freed_memory() if sys.argv[1] == "tuned" else False
    faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.manual_seed(0)
    w_gate_up, w_down = torch.randn(3072, 576) * 0.02, torch.randn(576, 1536) * 0.02
    def step(tokens):  # SmolLM2's MLP on one engine step: 25 MB, 12.5 MB and smaller temporaries at 2,048
        x = torch.randn(tokens, 576)
        gate, up = torch.nn.functional.linear(x, w_gate_up).split(1536, dim=-1)
        return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w_down)
    sizes = [2048, 2048, 1111, 2048, 300]  # full steps, then the end of a run
    # warm up until the heap has reached its high-water mark (a cycle without a page fault): how many cycles that
    # takes depends on where MKL's own buffers land between the activations (thread count, CPU vendor). Measured
    # with one thread: the 2nd and 3rd cycles still faulted 3,072 pages in (409 per step; one warm-up cycle
    # failed the bound below), every cycle after a fault-free one faulted none
    for _ in range(10):
        start = faults()
        for n in sizes:
            step(n)
        if faults() == start:
            break
    before = faults()
    for _ in range(3):
        for n in sizes:
            step(n)
    print(applied, (faults() - before) // (3 * len(sizes)))
""")


def faults_per_step(mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", CYCLES, mode], capture_output=True, text=True, check=True).stdout
    applied, faults = out.split()
    return applied == "True", int(faults)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_freed_activation_memory_is_reused_without_page_faults():
    applied, tuned = faults_per_step("tuned")
    assert applied
    assert tuned < 300, tuned  # measured: 0
    _, default = faults_per_step("default")
    # by default glibc hands some of these back to the OS and faults them in again next step (measured ~3,000
    # per step); where it does not (seen once, inside a full test run), there is nothing to compare against
    if default <= 1500:
        pytest.skip(f"glibc's default settings gave only {default} page faults per step here: no contrast to show")
