"""The pure SM-budget controller, driven with synthetic time and consumption."""
import pytest
from hypothesis import given, settings, strategies as st

from hami_bpf.throttle import (LEARN_MAX_S, TURN_FILL, TURN_HEADROOM, TURN_IDLE_PTS,
                               TURN_MAX_GAIN, TURN_PERIOD_S, TURN_STEP, Budget, DeviceView, Turn,
                               completion_rate, gpu_bound, learn_alone, neighbours, next_edge,
                               scale_rate, tick, turn_gains, turns)


def run(b, rate_fn, seconds, dt=0.05, device_fn=None, start=0.0, consumed=0):
    """Simulate a workload that launches at rate_fn() cost units/s within its budget."""
    t = start
    granted = tick(b, now=t, consumed=consumed)
    while t < start + seconds:
        t += dt
        want = rate_fn() * dt
        consumed += int(min(want, max(0, granted - consumed)) if not b.learning else want)
        granted = tick(b, now=t, consumed=consumed, device=device_fn(b) if device_fn else None)
    return consumed, granted


def test_learns_full_rate_then_caps_at_the_share():
    b = Budget(cap=30)
    # queue filling: a burst in the first 0.2 s that learning must ignore
    burst = iter([10_000_000] * 4)
    run(b, lambda: next(burst, 100_000), LEARN_MAX_S + 0.2)
    assert not b.learning
    assert abs(b.full_rate - 100_000) / 100_000 < 0.05
    assert abs(b.rate - 30_000) / 30_000 < 0.06


def test_a_loop_that_never_synchronizes_is_paced_from_its_launch_rate_early():
    # JAX's timed loop waits on a host callback, which no probe sees: it runs
    # unthrottled until its rate is learned.
    early = Budget(cap=25)
    run(early, lambda: 100_000, LEARN_MAX_S - 0.2)
    assert early.learning
    b = Budget(cap=25)
    run(b, lambda: 100_000, 2.0)    # paced within 2 s of its first launch
    assert not b.learning and not b.by_completion
    assert abs(b.full_rate - 100_000) / 100_000 < 0.05


def test_a_loop_that_has_synchronized_waits_for_its_next_synchronize():
    b = Budget(cap=25)
    tick(b, now=0.0, consumed=0)
    t, consumed = 0.0, 0
    while t < 2 * LEARN_MAX_S:
        t += 0.05
        consumed += 5_000
        # one synchronize, early: its completions are the better measure
        done = 5_000 if t >= 0.3 else None
        tick(b, now=t, consumed=consumed, completed=done, completed_at=0.3 if done else None)
    assert b.learning


def test_open_loop_throughput_is_cap_times_full_rate():
    b = Budget(cap=50)
    run(b, lambda: 200_000, LEARN_MAX_S + 0.2)
    c0 = b.last_consumed
    c1, _ = run(b, lambda: 200_000, 4.0, start=b.last_t, consumed=c0)
    achieved = (c1 - c0) / 4.0
    assert abs(achieved / 200_000 - 0.5) < 0.03


def test_alone_on_a_saturated_device_the_pace_is_the_full_rate():
    b = Budget(cap=25)
    run(b, lambda: 50_000, LEARN_MAX_S + 0.2,
        device_fn=lambda b: DeviceView(100.0, 0.0, 0.0))
    assert not b.contended
    assert abs(b.full_rate - 50_000) / 50_000 < 0.05
    assert abs(b.work_per_unit - 1 / 50_000) * 50_000 < 0.05


def test_sharing_a_saturated_device_scales_the_pace_to_the_whole_device():
    # Two groups launching the same kernels at the same rate on a saturated
    # device each got half of it: alone, each would run twice as fast.
    b = Budget(cap=30)
    run(b, lambda: 40_000, LEARN_MAX_S + 0.2,
        device_fn=lambda b: DeviceView(100.0, 0.0, 40_000.0))
    assert b.contended
    assert abs(b.full_rate - 80_000) / 80_000 < 0.06
    assert abs(b.rate - 24_000) / 24_000 < 0.06


def test_a_known_neighbours_part_is_subtracted():
    # A neighbour known to take 30% of the device: this group had 70% of it.
    b = Budget(cap=70)
    run(b, lambda: 70_000, LEARN_MAX_S + 0.2,
        device_fn=lambda b: DeviceView(100.0, 30.0, 0.0))
    assert abs(b.full_rate - 100_000) / 100_000 < 0.06


def test_an_unsaturated_device_means_no_contention():
    b = Budget(cap=50)
    run(b, lambda: 10_000, LEARN_MAX_S + 0.2,
        device_fn=lambda b: DeviceView(40.0, 0.0, 10_000.0))
    assert not b.contended
    assert abs(b.full_rate - 10_000) / 10_000 < 0.05


@settings(max_examples=200, deadline=None)
@given(cap=st.integers(1, 99), util=st.floats(0, 100), known=st.floats(0, 100),
       others=st.floats(0, 1e7))
def test_the_learned_rate_is_never_below_the_pace_nor_unbounded(cap, util, known, others):
    b = Budget(cap=cap)
    run(b, lambda: 10_000, LEARN_MAX_S + 0.2,
        device_fn=lambda b: DeviceView(util, known, others))
    assert not b.learning
    assert 10_000 * 0.9 <= b.full_rate <= 10_000 * 1.1 * 100 / (100 * 0.05)
    assert b.rate >= 1.0


def test_idle_group_cannot_bank_a_long_burst():
    b = Budget(cap=50)
    run(b, lambda: 100_000, LEARN_MAX_S + 0.2)
    c = b.last_consumed
    _, granted = run(b, lambda: 0, 5.0, start=b.last_t, consumed=c)
    assert granted - c <= b.rate * 0.05 + 1


def test_neighbours_split_known_parts_and_pass_on_unknown_rates():
    known = Budget(cap=30)
    known.work_per_unit = 1e-5          # 10 us per unit
    known.rate = 1.0
    v = neighbours(90.0, {"a": 30_000.0, "b": 5.0, "c": 7.0}, {"a": known})
    assert v["b"] == DeviceView(90.0, pytest.approx(30.0), 7.0)
    assert v["a"] == DeviceView(90.0, 0.0, 12.0)
    assert neighbours(None, {"a": 1.0}, {})["a"].util is None


def simulate_queued_gpu(cap, seconds=8.0, gpu_rate=1000.0, queue_s=1.1, sync_every=0.25, dt=0.01,
                        device=None, exact_times=False):
    """A host that launches as fast as the launch queue allows (queue_s of GPU
    work) and synchronizes every sync_every seconds of enqueueing, like
    bench/gpu/sm_workload.py; the GPU drains at gpu_rate. Returns the GPU's
    completion rate over the last 3 s."""
    b = Budget(cap=cap)
    t, launched, done = 0.0, 0.0, 0.0
    granted = tick(b, now=t, consumed=0)
    phase_start, syncing, sync_target = 0.0, False, 0.0
    completed_mark = None
    completed_t = None
    done_at = []
    sync_ns = waited = 0
    while t < seconds:
        t += dt
        done = min(launched, done + gpu_rate * dt)
        done_at.append((t, done))
        if syncing:
            waited += int(dt * 1e9)
            if done >= sync_target:
                syncing, phase_start = False, t
                completed_mark = sync_target
                # the probe's time: within the tick, before the tick's `now`;
                # like the probe, the wait is counted when the call returns
                completed_t = t - dt / 2
                sync_ns, waited = sync_ns + waited, 0
        else:
            room_queue = max(0.0, done + gpu_rate * queue_s - launched)
            room_budget = max(0.0, granted - launched)
            launched += min(room_queue, room_budget, gpu_rate * 50 * dt)
            if t - phase_start >= sync_every:
                syncing, sync_target = True, launched
        granted = tick(b, now=t, consumed=int(launched), sync_ns=sync_ns, device=device,
                       completed=None if completed_mark is None else int(completed_mark),
                       completed_at=completed_t if exact_times else None)
    t0, d0 = next((tt, d) for tt, d in done_at if tt >= seconds - 3.0)
    return (done - d0) / (t - t0) / gpu_rate, b


@pytest.mark.parametrize("cap", [25, 50, 75])
def test_caps_a_deep_launch_queue_by_its_completions(cap):
    achieved, b = simulate_queued_gpu(cap)
    assert b.by_completion
    assert abs(achieved * 100 - cap) <= 5, (achieved, b)


@pytest.mark.parametrize("util", [100.0, 60.0, None])
def test_a_busy_device_learns_from_the_first_window(util):
    # Warm-up, one synchronize, then a window that fills a 1.1 s launch queue
    # and a synchronize that returns ~1.1 s later. The device was busy with
    # this group alone: those two completions give its pace at once, rather
    # than a second later (H200 matmuls settled 2.5-3.5 s in, over the 2 s
    # target). NVML says so (100), or lags (60: its average still holds the
    # idle spell before), or is absent: the wait in synchronize says so then.
    b = Budget(cap=50)
    gpu, t, dt = 1000.0, 0.0, 0.01
    tick(b, now=t, consumed=0)
    launched, done, marks, sync_ns, waited = 10.0, 0.0, [], 0, 0
    sync_at = launched                      # warm-up: 10 units, then synchronize
    while b.learning and t < 3.0:
        t += dt
        done = min(launched, done + gpu * dt)
        if sync_at is not None:
            waited += int(dt * 1e9)
        if sync_at is not None and done >= sync_at:
            marks.append(int(sync_at))
            sync_at, sync_ns, waited = None, sync_ns + waited, 0   # counted on return
            window_end = t + 0.25
        elif sync_at is None and t < window_end:
            launched = min(done + gpu * 1.1, launched + gpu * 50 * dt)
        elif sync_at is None:
            sync_at = launched
        tick(b, now=t, consumed=int(launched), completed=marks[-1] if marks else None,
             sync_ns=sync_ns, device=DeviceView(util, 0.0, 0.0))
    assert not b.learning and b.by_completion
    assert t < 1.5, t
    assert abs(b.full_rate - gpu) / gpu < 0.05, b.full_rate


@pytest.mark.parametrize("cap", [25, 50, 75])
def test_a_deep_launch_queue_that_is_never_synchronized_is_capped_by_its_launch_rate(cap):
    # Learned after 1.5 s of launching: the second-deep queue filled long
    # before, and the host launches at the GPU's pace from then on. The
    # queue's second of work then drains at (100 - cap)% a second: at 75,
    # 4.4 s (judged over the last 3 s of 12).
    achieved, b = simulate_queued_gpu(cap, seconds=12.0, sync_every=1e9)
    assert not b.by_completion and abs(b.full_rate - 1000.0) / 1000.0 < 0.05, b
    assert abs(achieved * 100 - cap) <= 5, (achieved, b)


def test_rare_synchronizes_are_waited_for():
    # A batch of large matmuls fills a 2 s launch queue, then one
    # synchronize: completions come every ~2 s, later than LEARN_MAX_S
    # (H200: such a pair learned from the host's launch rate, 46/48% for 30/70).
    achieved, b = simulate_queued_gpu(50, seconds=16.0, queue_s=2.0)
    assert b.by_completion
    assert abs(achieved * 100 - 50) <= 5, (achieved, b)


@pytest.mark.parametrize("exact_times", [False, True])
def test_a_gpu_bound_pair_keeps_the_contention_scaling(exact_times):
    # Sharing a saturated device with an equal neighbour, it waits in
    # synchronize most of the time: the GPU, not its host loop, held it back.
    # With the probe's own completion times the span ends inside a tick,
    # before the tick that counts the closing wait.
    _, b = simulate_queued_gpu(30, seconds=6.0, gpu_rate=500.0,
                               device=DeviceView(100.0, 0.0, 500.0), exact_times=exact_times)
    assert b.contended and not b.launcher_bound
    assert abs(b.full_rate - 1000) / 1000 < 0.1, b


def learn_with(b, step, dt=0.05, limit=10.0):
    """Tick b every dt until it has learned: step(n) gives the n-th tick's
    arguments (cumulative counters, device view) except `now`."""
    n = 0
    tick(b, now=0.0, consumed=0)
    while b.learning and n * dt < limit:
        n += 1
        tick(b, now=n * dt, **step(n))


def test_a_launch_bound_pair_is_not_taken_for_a_gpu_bound_one():
    # Two launch-bound groups fill NVML's utilization between them, yet each
    # launches as fast as its own loop, waiting little in synchronize (H200,
    # small kernels: the first learned twice its rate, 46% for a cap of 30).
    b = Budget(cap=30)
    learn_with(b, lambda n: dict(
        consumed=4000 * n, completed=4000 * n - 400,   # 80k/s of its own loop
        sync_ns=5_000_000 * (n // 5),                   # a synchronize every 0.25 s, 5 ms long
        device=DeviceView(100.0, 0.0, 80_000.0)))
    assert b.contended and b.launcher_bound
    assert abs(b.full_rate - 80_000 / 0.98) / 80_000 < 0.05, b.full_rate


def test_a_neighbour_learning_meanwhile_restarts_the_window():
    # Two groups share a device half and half; the other one learns first and
    # is held to 70% from then on, leaving this one 30%. Its pace must come
    # from after that change, split by the state after it: 30k of 100k.
    b = Budget(cap=30)

    def step(n):                       # the change comes 4.5 s in (tick 90)
        consumed = 2500 * min(n, 90) + 1500 * max(0, n - 90)   # 50k/s, then 30k/s
        syncs = (n + 20) // 40         # a synchronize every 2 s (at 1, 3, ...),
        last = 40 * syncs - 20         # waiting 1.5 s of each for the GPU
        done = 2500 * min(last, 90) + 1500 * max(0, last - 90) if syncs else None
        return dict(consumed=consumed, completed=done, sync_ns=1_500_000_000 * syncs,
                    device=DeviceView(100.0, 70.0, 0.0) if n > 90
                    else DeviceView(100.0, 0.0, 50_000.0))
    learn_with(b, step)
    assert b.by_completion and b.contended
    assert abs(b.pace - 30_000) / 30_000 < 0.05, b.pace
    assert abs(b.full_rate - 100_000) / 100_000 < 0.1, b.full_rate


def test_a_tiny_rate_still_grants_over_time():
    # Rounding each tick's grant to an integer once granted nothing at a few
    # units per second, and a held TP=2 job never resumed (H200 x2).
    b = Budget(cap=10)
    run(b, lambda: 40, LEARN_MAX_S + 0.2)
    assert not b.learning and b.rate < 5
    over = b.granted + 3                 # a launch overshot the budget: held
    t = b.last_t
    for _ in range(200):                 # 10 s of 50 ms ticks, nothing launched
        t += 0.05
        granted = tick(b, now=t, consumed=over)
    assert granted > over


def test_without_lending_a_cap_always_holds():
    from hami_bpf.throttle import held_to_cap
    assert held_to_cap(1, "default", False, [])
    assert held_to_cap(1, "default", False, [(0, False)])


def test_lending_holds_only_while_higher_or_equal_priority_is_busy():
    from hami_bpf.throttle import held_to_cap
    assert not held_to_cap(1, "default", True, [])                 # alone: free
    assert not held_to_cap(1, "default", True, [(0, False)])       # high idle: free
    assert held_to_cap(1, "default", True, [(0, True)])            # high busy: held
    assert held_to_cap(1, "default", True, [(1, True)])            # equal busy: held
    assert not held_to_cap(0, "default", True, [(1, True)])        # lower busy: free
    assert held_to_cap(1, "force", True, [])                       # force: always


def test_sched_takes_the_lower_priority_and_the_stricter_policy():
    from hami_bpf.limits import effective_sched, load_policy, parse_env_limits
    env, _ = parse_env_limits({"CUDA_TASK_PRIORITY": "0"})
    assert effective_sched(None, "g", env) == (0, "default")
    pol = load_policy('[default]\npriority = 2\n', "p.toml")
    # the workload asks for 0: it cannot raise its priority above the policy's
    assert effective_sched(pol, "g", env) == (2, "default")
    env2, _ = parse_env_limits({"CUDA_TASK_PRIORITY": "5", "GPU_CORE_UTILIZATION_POLICY": "force"})
    assert effective_sched(None, "g", env2) == (5, "force")
    assert effective_sched(None, "g", None) == (1, "default")


def test_a_host_bound_launcher_is_credited_the_probes_cost():
    # 100k launches/s with 2 us of probe each: 20% of its time was the probe;
    # uncapped (no probe) it launches 125k/s, and caps are shares of that.
    b = Budget(cap=50, probe_s=2e-6)
    t, consumed, launches = 0.0, 0, 0
    tick(b, now=t, consumed=0, launches=0)
    while b.learning:
        t += 0.05
        consumed += 5000
        launches += 5000
        tick(b, now=t, consumed=consumed, launches=launches,
             device=DeviceView(30.0, 0.0, 0.0))
    assert abs(b.probe_share - 0.2) < 0.01
    assert abs(b.full_rate - 125_000) / 125_000 < 0.03


def test_a_saturated_device_gets_no_probe_credit():
    b = Budget(cap=50, probe_s=2e-6)
    run(b, lambda: 100_000, LEARN_MAX_S + 0.2, device_fn=lambda b: DeviceView(100.0, 0.0, 0.0))
    assert b.probe_share == 0.0


def test_setting_up_is_not_learned_as_the_full_rate():
    # A training process launches a trickle while it builds its model and
    # optimizer, then steps at full speed (H200: a rate learned from the
    # trickle held a capped training loop to 0.05 steps/s).
    b = Budget(cap=50)
    t, consumed = 0.0, 0
    tick(b, now=t, consumed=0)
    while t < 6.0:                         # set-up: a few launches now and then
        t += 0.05
        if int(t * 20) % 15 == 0:
            consumed += 100
        tick(b, now=t, consumed=consumed)
    assert b.learning
    c0 = consumed
    while b.learning:                      # then steady stepping, no synchronize
        t += 0.05
        consumed += 10_000
        tick(b, now=t, consumed=consumed)
    assert abs(b.full_rate - 200_000) / 200_000 < 0.05, b.full_rate
    assert consumed - c0 > 0


def test_completions_are_preferred_as_soon_as_they_come():
    b = Budget(cap=50)
    t, consumed = 0.0, 0
    tick(b, now=t, consumed=0)
    for i in range(1, 40):                 # 2 s: launches 5000/s, completions 1000/s
        t = i * 0.05
        consumed += 250
        tick(b, now=t, consumed=consumed, completed=int(1000 * t) if t > 0.3 else None)
        if not b.learning:
            break
    assert not b.learning and b.by_completion
    assert abs(b.full_rate - 1000) / 1000 < 0.1


def test_a_group_that_stopped_synchronizing_has_no_completion_rate():
    # Neighbours take a known group's part from its completion rate: one
    # from completions long gone would be a guess, not a measurement.
    b = Budget(cap=50)
    tick(b, now=0.0, consumed=0)
    tick(b, now=1.0, consumed=1000, completed=500)
    tick(b, now=2.0, consumed=2000, completed=1500)
    assert completion_rate(b, 2.0) == pytest.approx(1000)
    tick(b, now=20.0, consumed=3000)
    assert completion_rate(b, 20.0) is None


def test_a_launcher_waiting_on_the_gpu_gets_no_probe_credit():
    # NVML reads low (its average still holds an idle spell), but the group
    # waited in synchronize most of the time: the GPU set its pace.
    b = Budget(cap=50, probe_s=2e-6)
    learn_with(b, lambda n: dict(
        consumed=5000 * n, launches=5000 * n, completed=5000 * (n - n % 5) or None,
        sync_ns=40_000_000 * n,                # 40 of every 50 ms in synchronize
        device=DeviceView(30.0, 0.0, 0.0)))
    assert not b.learning and b.probe_share == 0.0
    assert abs(b.full_rate - 100_000) / 100_000 < 0.05, b.full_rate


def test_a_neighbour_blocked_on_its_queue_still_counts_by_what_it_completes():
    # It launched nothing this tick (its queue is full), yet the device is
    # busy with its work: a learning group must not take the device as its own.
    v = neighbours(100.0, {"me": 50_000.0, "blocked": 0.0}, {}, now=1.0,
                   done_rates={"blocked": 50_000.0, "me": 50_000.0})
    assert v["me"].unknown_others_rate == 50_000.0
    assert neighbours(100.0, {"me": 5.0, "idle": 0.0}, {}, now=1.0,
                      done_rates={"idle": None})["me"].unknown_others_rate == 0.0


def next_to_unpaced(unpaced_until):
    """Ticks of a GPU-bound group (50k/s, synchronizing every 0.25 s, mostly
    waiting) next to a neighbour with no pace until `unpaced_until` s: it
    launches nothing until then (blocked on its full queue), 50k/s after."""
    def step(n):
        t = n * 0.05
        return dict(consumed=2500 * n, completed=2500 * (n - n % 5) or None,
                    sync_ns=40_000_000 * n,
                    device=DeviceView(100.0, 0.0, 50_000.0 if t >= unpaced_until else 0.0,
                                      others_unpaced=t < unpaced_until))
    return step


def test_waits_while_a_busy_neighbour_has_no_pace_yet():
    # The neighbour filled its queue and blocks: it launches nothing and has
    # not synchronized yet, so nothing says how much of the device it holds
    # (the simulator: a 70% group learned half the device as its whole).
    b = Budget(cap=70)
    learn_with(b, next_to_unpaced(2.0))
    # Not from a span that still had the unpaced neighbour in it: split 50/50.
    assert not b.learning and b.contended and abs(b.full_rate - 100_000) / 100_000 < 0.1, b.full_rate


@pytest.mark.parametrize("unpaced_until", [4.6, 99.0])
def test_a_neighbour_unpaced_past_the_wait_is_not_taken_for_an_idle_one(unpaced_until):
    # It started 1 s late and blocked on its queue until its second
    # synchronize came, later than LEARN_SHARED_S: ticks from before that
    # must not give it the launch rate it had (nothing) as its part; with
    # no tick to go by, the GPU time-slices the two evenly (H200, matmul pair
    # 30/70: the 30% group learned half its full rate, 15.9% for a cap of 30).
    b = Budget(cap=30)
    learn_with(b, next_to_unpaced(unpaced_until))
    assert not b.learning and b.contended
    assert abs(b.full_rate - 100_000) / 100_000 < 0.1, b.full_rate


def test_a_gpu_bound_group_read_while_nvml_lags_gets_no_probe_credit():
    # H200 matmuls alone: 600 launches/s, NVML's average still low from the
    # idle before, the launcher blocked in its launches (full queue), not in
    # synchronize. A 0.04% probe share is no sign of a host-bound group.
    b = Budget(cap=50, probe_s=0.7e-6)
    learn_with(b, lambda n: dict(consumed=30 * 132 * n, launches=30 * n,
                                 completed=30 * 132 * (n - n % 5) or None,
                                 sync_ns=1_000_000 * (n // 5),
                                 device=DeviceView(60.0, 0.0, 0.0)))
    assert not b.learning and b.probe_share == 0.0 and b.full_rate == b.pace


# -- turns -------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, 20), st.integers(1, 99), min_size=2, max_size=6),
       st.floats(0, 1000))
def test_turns_never_overlap_and_each_is_as_long_as_its_cap(caps, epoch):
    slots = turns(caps, epoch=epoch)
    assert set(slots) == set(caps)
    scale = max(100, sum(caps.values()))
    spans = sorted((t.start, t.start + t.length) for t in slots.values())
    assert spans[0][0] == 0 and spans[-1][1] <= 1 + 1e-9
    assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))
    for k, t in slots.items():
        assert t.length == pytest.approx(caps[k] / scale)


def test_one_group_alone_takes_no_turn():
    assert turns({(1, 0): 30}, epoch=0.0) == {}


@given(st.floats(0, 0.99), st.floats(0.01, 1.0), st.floats(0, 10), st.floats(0, 10))
def test_a_turns_edges_hold_now_or_come_next(start, length, epoch, now):
    t = Turn(epoch, TURN_PERIOD_S, start, min(length, 1 - start))
    t0, t1 = t.edges(now)
    assert t1 > now - 1e-9 and t0 <= t1
    assert t1 - t0 == pytest.approx(t.length * t.period)
    assert t0 - now < t.period + 1e-9
    # The slot's start if it is still ahead, else its end, else nothing.
    assert next_edge([t], now) == (t0 if t0 > now else t1 if t1 > now else None)


def learned(cap, full_rate):
    b = Budget(cap=cap)
    run(b, lambda: full_rate, LEARN_MAX_S + 0.2)
    assert not b.learning
    return b


def test_a_turn_grants_its_slots_work_as_it_begins_and_nothing_after():
    b = learned(30, 100_000)
    turn = Turn(epoch=0.0, period=0.1, start=0.3, length=0.7)
    consumed = b.last_consumed
    t = 10.0                                   # a period's start: the slot is 0.03 s on
    assert tick(b, now=t + 0.01, consumed=consumed, turn=turn) <= consumed
    g = tick(b, now=t + 0.031, consumed=consumed, turn=turn)
    # All but what handing the GPU over takes (TURN_FILL).
    assert g - consumed == pytest.approx(b.full_rate * 0.07 * TURN_FILL, rel=0.01)
    # Launching it all at once takes nothing more from the same slot.
    assert tick(b, now=t + 0.05, consumed=g, turn=turn) == g
    # Left unspent at the slot's end: taken back.
    assert tick(b, now=t + 0.101, consumed=g - 500, turn=turn) == g - 500


def test_groups_taking_turns_launch_one_at_a_time_at_their_caps():
    a, b = learned(30, 100_000), learned(70, 100_000)
    slots = turns({"a": 30, "b": 70}, epoch=0.0)
    ca, cb = a.last_consumed, b.last_consumed
    sa, sb = ca, cb
    launched_in = {"a": set(), "b": set()}
    t = 10.0
    for i in range(2000):              # 2 s in 1 ms ticks: each launches what it may at once
        t = 10.0 + i * 0.001
        ga = tick(a, now=t, consumed=ca, turn=slots["a"])
        gb = tick(b, now=t, consumed=cb, turn=slots["b"])
        if ga > ca:
            launched_in["a"].add(i % 100)
            ca = ga
        if gb > cb:
            launched_in["b"].add(i % 100)
            cb = gb
    assert (ca - sa) / 2.0 == pytest.approx(30_000 * TURN_FILL, rel=0.01)
    assert (cb - sb) / 2.0 == pytest.approx(70_000 * TURN_FILL, rel=0.01)
    # Each at its slot's start (the tick after, where float time falls short).
    assert launched_in["a"] <= {0, 1} and launched_in["b"] <= {30, 31}


def test_a_budget_leaving_its_turns_refills_again():
    b = learned(50, 100_000)
    turn = Turn(epoch=0.0, period=0.1, start=0.5, length=0.5)
    c = b.last_consumed
    tick(b, now=10.01, consumed=c, turn=turn)         # outside its slot: nothing
    g = tick(b, now=10.2, consumed=c)                 # no turns any more: the bank refills
    assert g > c


def test_a_launch_past_the_slots_work_is_paid_from_the_next():
    b = learned(30, 100_000)
    turn = Turn(epoch=0.0, period=0.1, start=0.0, length=0.3)
    c = b.last_consumed
    g = tick(b, now=10.001, consumed=c, turn=turn)
    lump = g - c
    # The launch that found the slot spent went through (the probe stops after it).
    over = g + 1000
    tick(b, now=10.05, consumed=over, turn=turn)
    g2 = tick(b, now=10.101, consumed=over, turn=turn)
    assert g2 - over == pytest.approx(lump - 1000, abs=2)


def side_by_side(**kw):
    b = learned(kw.pop("cap", 30), 100_000)
    b.contended, b.by_completion, b.turn_slots = True, True, 15
    for k, v in kw.items():
        setattr(b, k, v)
    return b


def test_turns_idling_the_gpu_raise_rates_learned_side_by_side():
    slots = list(turns({"a": 30, "b": 70}, epoch=0.0).values())
    a, b = side_by_side(), side_by_side(cap=70)
    gains = turn_gains(90.0, slots, [a, b])
    assert gains == [pytest.approx(1 + (100 - TURN_HEADROOM - 90.0) / 100)] * 2
    f = a.full_rate
    scale_rate(a, gains[0])
    scale_rate(b, gains[1])
    assert a.full_rate == pytest.approx(f * gains[0]) and a.rate == pytest.approx(0.3 * a.full_rate)
    # At most TURN_MAX_GAIN in all, however idle it stays.
    assert turn_gains(10.0, slots, [a, b]) == [pytest.approx(TURN_MAX_GAIN / gains[0])] * 2


def test_the_idle_time_is_the_slots_of_the_groups_that_learned_side_by_side():
    # H200, the 70 group first (alone: its rate right), the 30 one next to it:
    # raising both alike put the 70 one 17% over and its work into the 30's slots.
    slots = list(turns({"a": 30, "b": 70}, epoch=0.0).values())
    a, b = side_by_side(), side_by_side(cap=70, contended=False)
    gains = turn_gains(94.0, slots, [a, b])
    assert gains == [pytest.approx(1 + (100 - TURN_HEADROOM - 94.0) / 30), 1.0]


def test_raised_rates_whose_turns_overran_are_lowered_a_step_at_a_time():
    slots = list(turns({"a": 30, "b": 70}, epoch=0.0).values())
    a, b = side_by_side(turn_gain=1.09), side_by_side(cap=70, turn_gain=1.01)
    b.turn_short = 2            # its synchronizes waited past its slots: the GPU is behind
    assert turn_gains(100.0, slots, [a, b]) is None     # once: maybe one that spanned a slot
    b.turn_short_before = 1     # and in the reading before
    assert turn_gains(100.0, slots, [a, b]) == [pytest.approx(1 / TURN_STEP), pytest.approx(1 / 1.01)]
    a.turn_gain = 1.0           # never below what it learned
    assert turn_gains(100.0, slots, [a, b]) == [1.0, pytest.approx(1 / 1.01)]
    b.turn_short = 0
    assert turn_gains(100.0, slots, [a, b]) is None


@pytest.mark.parametrize("why", ["busy", "short", "few", "alone"])
def test_turns_raise_no_rate_without_cause(why):
    slots = list(turns({"a": 30, "b": 70}, epoch=0.0).values())
    a, b = side_by_side(), side_by_side(cap=70)
    util = 90.0
    if why == "busy":
        util = 100 - TURN_IDLE_PTS + 0.5      # the handoffs' own idle time
    elif why == "short":
        b.turn_short = 1                      # a slot it did not fill: idle by its own doing
    elif why == "few":
        a.turn_slots = 2
    else:
        a.contended = b.contended = False     # rates learned alone are the GPU's
    assert turn_gains(util, slots, [a, b]) is None


@pytest.mark.parametrize("why", ["launcher", "host", "host-rate"])
def test_only_gpu_bound_groups_take_turns(why):
    b = side_by_side()
    assert gpu_bound(b)
    if why == "launcher":
        b.launcher_bound = True               # its host, not the GPU, set its pace
    elif why == "host":
        b.probe_share = 0.05
    else:
        b.by_completion = False
    assert not gpu_bound(b)


# -- learning alone ------------------------------------------------------------

def test_one_group_learns_at_a_time_first_come_and_holds_the_rest():
    learners = {"late": (2.0, 1), "early": (1.0, 1)}
    capped = {"late": 1, "early": 1, "running": 1}
    key, held = learn_alone(learners, capped)
    assert key == "early" and held == {"late", "running"}
    # It keeps its turn whoever arrives after.
    assert learn_alone({**learners, "new": (0.5, 1)}, {**capped, "new": 1}, current="early")[0] == "early"


def test_a_higher_priority_learns_first_and_is_never_held_for_a_lower_one():
    learners = {"low": (1.0, 5), "high": (2.0, 0)}
    capped = {"low": 5, "high": 0, "running-high": 0, "running-low": 5}
    key, held = learn_alone(learners, capped, current="low")
    assert key == "high" and held == {"low", "running-high", "running-low"}
    key, held = learn_alone({"low": (1.0, 5)}, capped, current="low")
    assert key == "low" and held == {"running-low"}


def test_no_learner_holds_nothing():
    assert learn_alone({}, {"a": 1}) == (None, frozenset())


@given(st.dictionaries(st.integers(0, 9), st.tuples(st.floats(0, 100), st.integers(0, 3)),
                       min_size=1),
       st.dictionaries(st.integers(10, 19), st.integers(0, 3)), st.one_of(st.none(), st.integers(0, 9)))
def test_the_learner_is_never_held_and_holds_none_above_it(learners, others, current):
    capped = {**{k: p for k, (_s, p) in learners.items()}, **others}
    key, held = learn_alone(learners, capped, current=current)
    assert key in learners and key not in held
    assert all(capped[k] >= learners[key][1] for k in held)
    assert learners[key][1] == min(p for _s, p in learners.values())


@pytest.mark.parametrize("wait_s", [0.6, 2.0, 5.0])
def test_a_wait_while_learning_starts_learning_over(wait_s):
    # A group warms up (launches that all complete), waits with nothing in
    # flight (its neighbour's warm-up, a barrier), then runs a steady loop
    # that synchronizes every 50 ms at 1e6 units/s: the rate it learns is
    # the loop's, not the loop's spread over the wait.
    b = Budget(cap=30)
    t, consumed = 0.0, 0
    tick(b, now=t, consumed=0, completed=0)
    for _ in range(6):                      # warm-up: 0.3 s, synchronized at its end
        t += 0.05
        consumed += 20_000
        tick(b, now=t, consumed=consumed, completed=consumed if t >= 0.29 else 0)
    done = consumed
    while t < 0.3 + wait_s:                 # waiting: nothing launched, nothing left
        t += 0.05
        tick(b, now=t, consumed=consumed, completed=done)
    assert b.learning
    while b.learning and t < 0.3 + wait_s + 6.0:
        t += 0.05
        consumed += 50_000
        done = consumed - 50_000            # a step behind: the last one in flight
        tick(b, now=t, consumed=consumed, completed=done, completed_at=t)
    assert not b.learning
    assert b.full_rate == pytest.approx(1e6, rel=0.1)
    assert b.restarts == 1


def test_a_short_pause_while_learning_is_not_a_restart():
    b = Budget(cap=30)
    t, consumed = 0.0, 0
    tick(b, now=t, consumed=0, completed=0)
    for i in range(60):
        t += 0.05
        if i % 10 != 9:                     # a 50 ms pause every 0.5 s, all done before it
            consumed += 50_000
        tick(b, now=t, consumed=consumed, completed=consumed, completed_at=t)
        if not b.learning:
            break
    assert not b.learning and b.restarts == 0
