"""A model of FwdConfig.page_pieces_all_warps's barrier protocol (kernels/sm90/fwd.py acquire_kv /
load_paged_block), checked over random interleavings on the CPU: four producer warps issue a key
block's TMA page pieces against one full barrier per stage; warp 0 alone arrives on it with the block's
transaction bytes, warps 1-3 only wait for the stage's empty barrier. The model follows PTX's mbarrier
rules as flash4 relies on them: a phase completes when its pending arrival count and its transaction
count are both 0; a TMA piece's complete_tx applies to the barrier's current phase when it lands and
may drive the transaction count below zero; waits test a phase's parity. Claims: the consumers never
see a stage's phase complete before every piece of that block landed, no piece lands in another
block's phase, and every run finishes (no deadlock). What it does not prove: the hardware's behaviour
(the GPU test tests/gpu/test_speed_switches.py::test_page_pieces_all_warps does that)."""

import random

import pytest

WARPS = 4


class Barrier:
    def __init__(self, arrivals: int):
        self.expected, self.pending, self.tx, self.phase = arrivals, arrivals, 0, 0

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending, self.tx = self.expected, 0

    def arrive(self, expect_tx: int = 0):
        assert self.pending > 0
        self.pending -= 1
        self.tx += expect_tx
        self._maybe_complete()

    def complete_tx(self, nbytes: int):
        self.tx -= nbytes
        assert self.tx > -(2 ** 20), "PTX's tx-count range"
        self._maybe_complete()

    def done(self, phase: int) -> bool:
        """Whether phase `phase` (0, 1, ...) has completed."""
        return self.phase > phase


def run(num_blocks: int, stages: int, pieces: int, piece_bytes: int, seed: int, all_warps: bool = True,
        others_wait_empty: bool = True):
    """One random interleaving; returns the consumed blocks' landed piece sets (asserts the claims).
    others_wait_empty=False: warps 1-3 skip the empty wait (a broken protocol, for the model's own test)."""
    rng = random.Random(seed)
    full = [Barrier(1) for _ in range(stages)]
    empty = [Barrier(1) for _ in range(stages)]  # one consumer arrival per release in the model
    landed = {}  # block -> pieces landed
    in_flight = []  # (block, piece, stage)
    # producer warp state: next block, and within it whether acquired / which pieces issued
    warps = [{"block": 0, "acquired": False, "next_piece": w if all_warps else 0} for w in range(WARPS)]
    step = WARPS if all_warps else 1
    active = range(WARPS) if all_warps else range(1)
    consumer = {"block": 0}

    def producer_actions(w):
        st = warps[w]
        b = st["block"]
        if b >= num_blocks:
            return []
        s, use = b % stages, b // stages
        if not st["acquired"]:
            # the empty barrier of use `use` is free once the consumers released use - 1 (use 0: free)
            if use == 0 or empty[s].done(use - 1) or (w > 0 and not others_wait_empty):
                return [("acquire", w)]
            return []
        return [("issue", w)]

    def do(action):
        kind, w = action
        st = warps[w]
        b = st["block"]
        s = b % stages
        if kind == "acquire":
            st["acquired"] = True
            if w == 0:  # warp 0: arrive with the whole block's bytes (producer_acquire)
                full[s].arrive(expect_tx=pieces * piece_bytes)
            if st["next_piece"] >= pieces:
                st.update(block=b + 1, acquired=False, next_piece=w if all_warps else 0)
        elif kind == "issue":
            in_flight.append((b, st["next_piece"], s))
            st["next_piece"] += step
            if st["next_piece"] >= pieces:
                st.update(block=b + 1, acquired=False, next_piece=w if all_warps else 0)

    steps = 0
    while consumer["block"] < num_blocks:
        steps += 1
        assert steps < 100_000, "no progress: deadlock"
        actions = [a for w in active for a in producer_actions(w)]
        if in_flight:
            actions.append(("land", None))
        b = consumer["block"]
        if full[b % stages].done(b // stages):
            actions.append(("consume", None))
        assert actions, f"deadlock at consumer block {b}"
        action = rng.choice(actions)
        if action[0] == "land":
            blk, piece, s = in_flight.pop(rng.randrange(len(in_flight)))
            # the piece must land in its own block's phase: its block's use of the stage is the
            # barrier's current (incomplete) phase
            assert full[s].phase == blk // stages, (blk, full[s].phase)
            landed.setdefault(blk, set()).add(piece)
            full[s].complete_tx(piece_bytes)
        elif action[0] == "consume":
            assert landed.get(b, set()) == set(range(pieces)), (b, landed.get(b))
            empty[b % stages].arrive()
            consumer["block"] += 1
        else:
            do(action)
    assert not in_flight
    return landed


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("pieces", [2, 4, 8, 16, 32])  # page 64 / 32 / 16 (x2 column chunks) / 8 at d128
def test_four_warp_pieces_protocol(stages, pieces):
    for seed in range(200):
        landed = run(num_blocks=7, stages=stages, pieces=pieces, piece_bytes=4096, seed=seed)
        assert set(landed) == set(range(7))


def test_single_warp_is_the_same_protocol():
    """Warp 0 alone (the shipped TMA pieces) under the same model."""
    for seed in range(100):
        run(num_blocks=6, stages=2, pieces=16, piece_bytes=4096, seed=seed, all_warps=False)


def test_model_catches_a_missing_arrival():
    """The model is not vacuous: with warp 0's arrival counting only its own pieces' bytes, a phase
    completes before the other warps' pieces landed, which the consumer's check catches."""
    original = Barrier.arrive

    def short_arrive(self, expect_tx=0):
        original(self, expect_tx // WARPS if expect_tx else 0)

    Barrier.arrive = short_arrive
    try:
        with pytest.raises(AssertionError):
            for seed in range(200):
                run(num_blocks=7, stages=2, pieces=16, piece_bytes=4096, seed=seed)
    finally:
        Barrier.arrive = original


def test_model_catches_warps_that_do_not_wait_for_the_empty_stage():
    """Warps 1-3 issuing without waiting for the stage's empty phase: some piece lands in the stage's
    previous block's phase (or overwrites a block the consumers still read), which the model flags."""
    with pytest.raises(AssertionError):
        for seed in range(200):
            run(num_blocks=7, stages=2, pieces=16, piece_bytes=4096, seed=seed, others_wait_empty=False)
