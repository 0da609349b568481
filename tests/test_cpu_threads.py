"""backends/cpu_threads.py: sizing torch's threads (affinity, cgroup quota, the option) and the controller that
lowers and raises them under contention, driven by a simulated machine (fake clocks), never by timings; and the
engine's greedy tokens when the thread count changes between steps."""
from __future__ import annotations

import threading

import pytest
import torch

from backends import cpu_threads as ct


# --- cgroup quota --------------------------------------------------------------------------------------------
def _cgroup(tmp_path, proc: str, files: dict[str, str]):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "proc_cgroup").write_text(proc)
    return ct.cgroup_cpu_quota(tmp_path, tmp_path / "proc_cgroup")


def test_cgroup_v2_quota_is_the_smallest_along_the_ancestors(tmp_path):
    files = {"a/cpu.max": "300000 100000\n", "a/b/cpu.max": "150000 100000\n", "a/b/c/cpu.max": "max 100000\n"}
    assert _cgroup(tmp_path, "0::/a/b/c\n", files) == 1.5


def test_cgroup_v2_without_quota_and_without_files(tmp_path):
    assert _cgroup(tmp_path, "0::/a\n", {"a/cpu.max": "max 100000\n", "cpu.max": "max 100000\n"}) is None
    assert _cgroup(tmp_path, "0::/nothing/here\n", {}) is None
    assert ct.cgroup_cpu_quota(tmp_path, tmp_path / "missing") is None


def test_cgroup_v2_path_of_another_namespace_falls_back_to_the_mounted_root(tmp_path):
    # inside a container /proc/self/cgroup names the host's path; the container's own cgroup is mounted at root
    assert _cgroup(tmp_path, "0::/kubepods/pod1/abc\n", {"cpu.max": "50000 100000\n"}) == 0.5


def test_cgroup_v1_quota(tmp_path):
    files = {"cpu,cpuacct/docker/x/cpu.cfs_quota_us": "250000\n", "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n"}
    assert _cgroup(tmp_path, "4:memory:/docker/x\n3:cpu,cpuacct:/docker/x\n", files) == 2.5
    unlimited = {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}
    assert _cgroup(tmp_path / "u", "1:cpu:/\n", unlimited) is None


def test_usable_cpus_caps_affinity_by_quota_rounded_up(monkeypatch):
    monkeypatch.setattr(ct.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    assert ct.usable_cpus(quota=None) == 8
    assert ct.usable_cpus(quota=1.5) == 2
    assert ct.usable_cpus(quota=2.0) == 2
    assert ct.usable_cpus(quota=0.3) == 1
    assert ct.usable_cpus(quota=64.0) == 8
    monkeypatch.setattr(ct.os, "sched_getaffinity", lambda pid: {3})
    assert ct.usable_cpus(quota=None) == 1


# --- the option ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, want", [(None, None), ("auto", None), (" AUTO ", None), ("", None), (3, 3),
                                         ("4", 4), (-1, -1), (" -2 ", -2)])
def test_parse_threads(value, want):
    assert ct.parse_threads(value) == want


@pytest.mark.parametrize("value", [0, "0", True, 2.5, "two", [2]])
def test_parse_threads_refuses_bad_values(value):
    with pytest.raises(ValueError, match=r"auto .*N > 0.*-K"):
        ct.parse_threads(value)


def test_choose_threads():
    auto = ct.choose_threads(None, usable=4, current=8, env={})
    assert (auto.threads, auto.adaptive) == (4, True) and "4 usable" in auto.why
    assert ct.choose_threads(None, usable=4, current=2, env={}).threads == 2  # the program's own count, kept
    assert ct.choose_threads(3, usable=4, current=8, env={}) == ct.ThreadChoice(3, False, "threads=3")
    c = ct.choose_threads(-1, usable=4, current=8, env={})
    assert (c.threads, c.adaptive) == (3, True)
    assert ct.choose_threads(-9, usable=4, current=8, env={}).threads == 1
    env = {"LITETURBO_THREADS": "1"}
    assert ct.choose_threads(None, usable=4, current=8, env=env) == ct.ThreadChoice(1, False, "LITETURBO_THREADS=1")
    assert ct.choose_threads(2, usable=4, current=8, env=env).threads == 2  # the option wins over the variable
    with pytest.raises(ValueError, match="LITETURBO_THREADS: threads must be"):
        ct.choose_threads(None, usable=4, current=8, env={"LITETURBO_THREADS": "many"})
    with pytest.warns(RuntimeWarning, match="more threads than the 2 core"):
        assert ct.choose_threads(5, usable=2, current=2, env={}).threads == 5


def test_apply_threads_keeps_the_programs_own_count(monkeypatch):
    monkeypatch.setattr(ct, "usable_cpus", lambda: 4)
    monkeypatch.setattr(ct, "_counts", {"program": None, "ours": None})
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the program's choice
        assert ct.apply_threads(None).threads == 1 and torch.get_num_threads() == 1
        torch.set_num_threads(3)  # changed by the program: followed
        assert ct.apply_threads(None).threads == 3
        assert ct.apply_threads(2).threads == 2 and torch.get_num_threads() == 2  # an engine's fixed count...
        ct.set_torch_threads(1)  # ...or a controller's
        assert ct.apply_threads(None).threads == 3  # is not taken for the program's
        assert ct.apply_threads(-1).threads == 3 and ct.apply_threads(-3).threads == 1
    finally:
        torch.set_num_threads(before)


def test_engine_config_threads_option():
    from lite.formats import LiteturboError
    from turbo import EngineConfig

    assert EngineConfig(device="cpu").threads is None
    assert EngineConfig(device="cpu", threads="auto").threads is None
    assert EngineConfig(device="cpu", threads="-1").threads == -1
    with pytest.raises(LiteturboError, match="threads: threads must be auto"):
        EngineConfig(device="cpu", threads=0)


def test_idle_cpu_seconds_reads_the_affinity_cpus(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 10 900 50 0 0 0 0 0\ncpu0 5 0 5 400 20 0 0 0 0 0\ncpu1 5 0 5 500 30 0 0 0 0 0\n"
                    "intr 1 2 3\n")
    tick = ct.os.sysconf("SC_CLK_TCK")
    assert ct.idle_cpu_seconds({0, 1}, stat) == pytest.approx(950 / tick)
    assert ct.idle_cpu_seconds({1}, stat) == pytest.approx(530 / tick)
    assert ct.idle_cpu_seconds({0}, tmp_path / "missing") is None


# --- the controller on a simulated 2-core machine ------------------------------------------------------------
class Machine:
    """Step times of batch-1 decode on ``cores`` cores with ``others`` busy processes beside it (fractions from the
    2-core machine: 1 thread 10 ms; 2 threads 5.6 ms idle; a descheduled team about 3x slower). Advances the fake
    wall clock, the stepping thread's CPU clock and the cores' idle time as the step runs."""

    def __init__(self, cores: int = 2, idle_readable: bool = True) -> None:
        self.cores, self.others, self.n = cores, 0, cores
        self.wall = self.cpu = self.idle = 0.0
        self.idle_readable = idle_readable
        self.sets: list[int] = []

    def set_threads(self, n: int) -> None:
        self.sets.append(n)
        self.n = n

    def step_time(self) -> tuple[float, float, float]:
        """(seconds, CPU share of the stepping thread, idle cores) of one step at the current count."""
        n, free = self.n, self.cores - self.others
        base = 0.010 / (1 + 0.8 * (n - 1))
        if n <= free:
            return base, 1.0, free - n
        return base * 3.0 * (n - free), 0.6, 0.0  # a thread of each region waits for the scheduler

    def controller(self, max_threads: int | None = None, **kw) -> ct.ThreadController:
        return ct.ThreadController(max_threads or self.cores, set_threads=self.set_threads, clock=lambda: self.wall,
                                   cpu_clock=lambda: self.cpu,
                                   idle_seconds=lambda: self.idle if self.idle_readable else None, **kw)

    def run(self, ctl: ct.ThreadController, steps: int, shape=(1, 1)) -> list[int]:
        """Run ``steps`` steps of ``shape`` (sequences, tokens; or a function of the step's index giving it);
        returns the thread count each ran at."""
        counts = []
        for i in range(steps):
            ctl.begin_step(*(shape(i) if callable(shape) else shape))
            dt, share, idle = self.step_time()
            counts.append(self.n)
            self.wall += dt
            self.cpu += dt * share
            self.idle += dt * idle
            ctl.end_step()
        return counts


def test_idle_machine_is_never_probed():
    m = Machine()
    ctl = m.controller()
    counts = m.run(ctl, 5000)
    assert set(counts) == {2} and ctl.probes == 0 and m.sets == [2]  # the stepping thread's count, once


def test_busy_process_lowers_then_releases_threads():
    m = Machine()
    ctl = m.controller()
    m.run(ctl, 100)
    m.others = 1
    counts = m.run(ctl, 200)
    first_one = counts.index(1)
    assert first_one < 60 and ctl.threads == 1 and ctl.switches == 1
    probes = ctl.probes
    counts = m.run(ctl, 3000)  # no idle core at 1 thread: no probing back up while the other process runs
    assert set(counts) == {1} and ctl.probes == probes
    m.others = 0
    counts = m.run(ctl, 200)
    assert counts[-1] == 2 and ctl.threads == 2 and counts.index(2) < 80
    assert ctl.switches == 2 and m.run(ctl, 2000) == [2] * 2000  # and idle again: no more probes
    assert ctl.describe()["threads"] == 2


def test_two_busy_processes_on_four_cores_leave_two_threads():
    m = Machine(cores=4)
    ctl = m.controller()
    m.others = 2
    counts = m.run(ctl, 400)
    assert counts[-1] == 2 and ctl.switches == 2
    m.others = 0
    assert m.run(ctl, 600)[-1] == 4


def test_a_losing_probe_backs_off():
    m = Machine()
    ctl = m.controller()
    m.step_time = lambda: (0.006, 0.7, 0.0) if m.n == 2 else (0.010, 1.0, 0.0)  # busy-looking, yet 2 is faster
    counts = m.run(ctl, 6000)
    assert ctl.threads == 2 and ctl.switches == 0
    assert 4 <= ctl.probes <= 9 and ctl.interval == ctl.max_interval  # 32, 64, ..., 1024 steps apart
    assert counts.count(1) == ctl.probes * (ctl.probe_steps + ctl.settle)  # a probe's cost: its candidate's steps


def test_probe_compares_steps_of_one_shape_only():
    m = Machine()
    ctl = m.controller()
    m.others = 1
    m.run(ctl, 100, shape=lambda i: (1 + i, 1 + i))  # a new batch every step: nothing to compare, the probe gives up
    assert ctl.threads == 2 and ctl.switches == 0 and ctl.probes == 1 and ctl.interval == 2 * ctl.base_interval
    assert m.n == 2  # an abandoned probe restores the count
    m.run(ctl, 200)
    assert ctl.threads == 1


def test_probe_compares_each_shape_with_itself():
    m = Machine()
    ctl = m.controller()
    m.others = 1
    # a step at 2 threads takes 3x longer for its shape; shapes cycle (a batch of 1 to 3): each step of the
    # candidate's phase is compared with its own shape's mean at the current count
    base = m.step_time
    m.step_time = lambda: (lambda t, s, f: (t * (1 + ctl._key[1] / 4), s, f))(*base())
    counts = m.run(ctl, 200, shape=lambda i: (1 + i % 3, 1 + i % 3))
    assert ctl.threads == 1 and ctl.switches == 1 and counts[-1] == 1


def test_speculative_decode_steps_adapt_like_decode_steps():
    m = Machine()
    ctl = m.controller()
    m.others = 1
    # one sequence verifying 8, then 3, then 8 drafts...: decode steps of a few shapes, at the decode count
    counts = m.run(ctl, 300, shape=lambda i: (1, 9 if i % 4 else 4, 8 if i % 4 else 3))
    assert ctl.threads == 1 and counts[-1] == 1 and ctl.switches == 1
    assert m.run(ctl, 1, shape=(1, 9, 0)) == [2]  # 9 tokens for 1 sequence without drafts: a prefill, full count


def test_prefill_steps_run_at_the_full_count_and_are_not_timed():
    m = Machine()
    ctl = m.controller()
    m.others = 1
    m.run(ctl, 200)
    assert ctl.threads == 1 and m.n == 1
    probes, sets = ctl.probes, len(m.sets)
    counts = m.run(ctl, 600, shape=lambda i: (2, 40) if i % 10 == 0 else (2, 2))  # a prefill every 10 steps
    assert [c for i, c in enumerate(counts) if i % 10 == 0] == [2] * 60  # prefills at max_threads
    assert set(c for i, c in enumerate(counts) if i % 10) == {1}  # decode of the new shape stays at 1
    assert ctl.probes == probes and len(m.sets) == sets + 120  # no probe, one change each way per prefill


def test_pauses_between_replies_do_not_count_as_free_cores():
    m = Machine()
    ctl = m.controller()
    m.others = 1
    m.run(ctl, 100)
    assert ctl.threads == 1
    probes = ctl.probes
    for _ in range(40):  # replies of 30 decode steps, 1 s apart: the cores idle meanwhile are not free for decode
        m.wall += 1.0
        m.idle += 1.0 * (m.cores - m.others)
        m.run(ctl, 30)
    assert ctl.threads == 1 and ctl.probes == probes


def test_without_idle_times_it_probes_up_periodically():
    m = Machine(idle_readable=False)
    ctl = m.controller()
    m.others = 1
    m.run(ctl, 100)
    assert ctl.threads == 1
    m.run(ctl, 4000)
    assert ctl.threads == 1 and 3 <= ctl.probes - 1 <= 9  # backed off
    m.others = 0
    m.run(ctl, 1200)
    assert ctl.threads == 2


def test_fixed_and_single_core_controllers_never_change_threads():
    for cores, adaptive in ((2, False), (1, True)):  # a fixed count; one core: nothing to adapt
        m = Machine(cores=cores)
        ctl = m.controller(adaptive=adaptive)
        assert not ctl.adaptive
        m.others = 1
        assert set(m.run(ctl, 500)) == {cores} and m.sets == [cores] and ctl.probes == 0
    inert = ct.ThreadController.inert()
    before = torch.get_num_threads()
    inert.begin_step()
    inert.end_step()
    assert torch.get_num_threads() == before


def test_a_new_stepping_thread_gets_the_count():
    m = Machine()
    ctl = m.controller()
    m.others = 1
    m.run(ctl, 100)
    assert m.sets[-1] == 1
    m.sets.clear()
    t = threading.Thread(target=m.run, args=(ctl, 1))
    t.start()
    t.join()
    assert m.sets == [1]  # OpenMP's thread count belongs to the calling thread


def test_controller_refuses_bad_settings():
    with pytest.raises(ValueError, match="max_threads"):
        ct.ThreadController(0)
    with pytest.raises(ValueError, match="base_interval"):
        ct.ThreadController(2, base_interval=10, max_interval=5)


# --- the engine: same greedy tokens whatever the count -------------------------------------------------------
class Alternating:
    """The engine's real controller, told to decode at 1 and 2 threads in turn (as probes switch counts)."""

    def __init__(self, ctl: ct.ThreadController, prefill_too: bool = False) -> None:
        self.ctl, self.prefill_too, self.steps, self.counts = ctl, prefill_too, 0, []

    def begin_step(self, seqs, tokens, drafts=0):
        self.steps += 1
        self.ctl._want = 2 - self.steps % 2  # 1 thread at the first step
        self.ctl.begin_step(seqs, seqs if self.prefill_too else tokens, 0 if self.prefill_too else drafts)
        self.counts.append(torch.get_num_threads())

    def end_step(self):
        self.ctl.end_step()


def _alternating_run(engine, prompt, gen, prefill_too: bool = False):
    ref = engine.generate(prompt, gen)
    real = engine.thread_control
    assert real.max_threads == 2 and real.adaptive
    alt = engine.thread_control = Alternating(real, prefill_too)
    try:
        out = engine.generate(prompt, gen)
    finally:
        engine.thread_control = real
        torch.set_num_threads(2)
    return ref, out, alt.counts


def test_w4a16_greedy_tokens_do_not_depend_on_the_thread_count(smollm2_rtn_g64):
    from turbo import Engine, GenerationConfig

    engine = Engine(smollm2_rtn_g64, device="cpu", max_kv_tokens=512, speculative_recent_tokens=0)  # both runs draft alike
    if engine.thread_control.max_threads < 2:
        pytest.skip("needs 2 usable cores")
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True, logprobs=2)
    prompt = engine.chat_template_ids([{"role": "user", "content": "Name three colors of the rainbow."}])
    ref, out, counts = _alternating_run(engine, prompt, gen, prefill_too=True)  # W4A16: prefill too
    assert counts[:4] == [1, 2, 1, 2]
    assert out.token_ids == ref.token_ids
    assert out.logprobs == ref.logprobs  # bit-identical: the kernels never split a reduction across threads
    # speculative verify steps (a few rows per sequence) run at the adapted count too: the same tokens and logprobs
    text = "The keeper climbed the stairs at dusk, trimmed the wick and wrote the weather in his log."
    prompt = engine.chat_template_ids([{"role": "user", "content": "Repeat exactly: " + text}])
    spec = GenerationConfig(max_new_tokens=24, ignore_eos=True, logprobs=2, speculative=4)
    before = engine.counters.spec_steps
    ref, out, counts = _alternating_run(engine, prompt, spec)
    assert engine.counters.spec_steps - before >= 4 and 1 in counts[1:]
    assert out.token_ids == ref.token_ids and out.logprobs == ref.logprobs


def test_bf16_greedy_tokens_do_not_depend_on_the_decode_thread_count(smollm2_path):
    import calib_data
    from turbo import Engine, GenerationConfig

    engine = Engine(smollm2_path, device="cpu", dtype="bfloat16", max_kv_tokens=1024, enable_prefix_caching=False)
    if engine.thread_control.max_threads < 2:
        pytest.skip("needs 2 usable cores")
    # a 400-token prompt: there oneDNN's bf16 GEMM rounds differently at 1 and 2 threads (hence prefill at 2)
    prompt = engine.encode("".join(calib_data.load_rows("wikitext2", "valid"))[:3000])[:400]
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True, logprobs=2)
    ref, out, counts = _alternating_run(engine, prompt, gen)
    assert counts[:4] == [2, 2, 1, 2]  # the prefill at the full count, then decode steps alternate
    assert out.token_ids == ref.token_ids and out.logprobs == ref.logprobs


def test_cli_device_options_reach_the_engine_config():
    import click
    from click.testing import CliRunner

    from turbo.cli_options import device_options as _device_options

    @click.command()
    @_device_options
    def cmd(device_opts):
        click.echo(f"threads={device_opts['threads']!r} tp={device_opts['tensor_parallel_size']}")

    for value, want in (("-1", "threads=-1"), (" 2 ", "threads=2"), ("auto", "threads='auto'")):
        r = CliRunner().invoke(cmd, ["--threads", value, "--tp", "2"])
        assert r.exit_code == 0 and r.output.strip() == want + " tp=2"
    assert CliRunner().invoke(cmd, []).output.strip() == "threads=None tp=1"
    r = CliRunner().invoke(cmd, ["--threads", "0"])
    assert r.exit_code == 2 and "Invalid value for '--threads'" in r.output and "-K" in r.output
    r = CliRunner().invoke(cmd, ["--tp", "0"])
    assert r.exit_code == 2 and "--tp" in r.output
