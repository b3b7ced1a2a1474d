"""A subscriber's malloc tuning: large frames stop faulting in fresh pages, and the user can opt out."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import probe

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# A Subscriber in its own process: prints whether the tuning applies, then the receiver's minor page faults
# per capture over the captures after a warm-up (the first ones fault in whatever the process keeps).
RECV = textwrap.dedent("""
    import resource, sys, probe
    from probe._malloc import keep_freed_frames
    sub = probe.Subscriber(sys.argv[1])
    print(keep_freed_frames(), flush=True)
    n, warm = int(sys.argv[2]), 40
    for i in range(n):
        if i == warm:
            r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        assert sub.recv(timeout=30) is not None
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / (n - warm), flush=True)
""")


class Echo(nn.Module):
    """Layers that return their input: every step is 4 captures of the same 3 MiB tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Identity() for _ in range(4)])

    def forward(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            inputs_embeds = layer(inputs_embeds)
        return inputs_embeds


def _faults_per_capture(env: dict[str, str]) -> tuple[str, float]:
    model, n = Echo(), 200
    x, ids = torch.randn(8, 128, 768), torch.zeros(8, 128, dtype=torch.long)  # 3 MiB per capture
    with probe.attach(model, "layers.*.resid_post", endpoint="tcp://127.0.0.1:*") as session:
        child = subprocess.Popen([sys.executable, "-c", RECV, session.endpoint, str(n)], stdout=subprocess.PIPE,
                                 text=True, env={**os.environ, **env})
        assert child.stdout is not None
        applied = child.stdout.readline().strip()
        session.wait_for_subscribers(1, timeout=30)
        for _ in range(n // 4):
            model(input_ids=ids, inputs_embeds=x)
        out, _ = child.communicate(timeout=60)
    assert child.returncode == 0
    return applied, float(out.split()[-1])


def test_subscriber_receives_large_frames_without_page_faults() -> None:
    applied, faults = _faults_per_capture({})
    off_applied, off = _faults_per_capture({"PROBEBUS_TUNE_MALLOC": "0"})  # the negative control
    assert (applied, off_applied) == ("True", "False")
    # 3 MiB is 768 pages. Measured on the 2-core VM: 5-19 faults per capture with the tuning, 86-143 without.
    assert faults < 40 and 2 * faults < off, f"page faults per 3 MiB capture: {faults:.1f} tuned, {off:.1f} not"


def test_glibc_variables_of_the_user_win() -> None:
    applied, _ = _faults_per_capture({"MALLOC_TRIM_THRESHOLD_": "1000000"})
    assert applied == "False"  # glibc's own variables leave malloc as the user set it


# The model's process: attach sets the same thresholds (no probed step faults freed heap pages back in),
# unless told not to. Printed from a fresh process, since the setting is process-wide and once only.
ATTACH = textwrap.dedent("""
    import sys, torch, probe
    from probe import _malloc
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Identity()])
    with probe.attach(model, "layers.0.resid_post", tune_malloc=sys.argv[1] == "1"):
        print(_malloc._state, flush=True)
""")


@pytest.mark.parametrize(("arg", "env", "expected"), [
    ("1", {}, "True"),
    ("0", {}, "None"),  # attach(tune_malloc=False) never calls mallopt
    ("1", {"PROBEBUS_TUNE_MALLOC": "0"}, "False"),
    ("1", {"MALLOC_MMAP_THRESHOLD_": "1000000"}, "False"),
])
def test_attach_tunes_the_models_process_unless_told_not_to(arg: str, env: dict[str, str], expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PROBEBUS_TUNE_MALLOC" and not k.startswith("MALLOC_")} | env
    out = subprocess.run([sys.executable, "-c", ATTACH, arg], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [expected]
