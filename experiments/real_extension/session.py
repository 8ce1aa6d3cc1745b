"""``--plan``: the next GPU session sized call by call from the stages' estimates (``costs``), before it runs.

Each call runs the shared stages (the corpus, then the conversion once the GGUF is joined), then every GPU's
part from where the last call stopped, under the same rule as the driver: a stage starts only if its budget
(margin x estimate + slack) fits in the call's --max-minutes; a training starts if its first checkpoint fits and
is stopped at the deadline (resuming costs its fixed time again). The GGUF travels in ``GGUF_PARTS`` parts, one
per call, the first call building the corpus (gpu_call.sh passes ``--tokenizer``); the conversion waits for the last
part.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .pipeline import Stage

DEVICE_KINDS = {1: "nvidia-h200 or nvidia-h100-x1", 2: "nvidia-h200-x2 or nvidia-h100-x2"}
# What each call carries (ignored paths; with the working tree under the 64 MiB of a call): the 98 MB GGUF split
# with `split -n 4 -d` over the first calls to one warm machine, one part each (.gguf/SHA256 names the parts and
# the whole; gpu_call.sh joins them), then nothing of it; the wheels in the first call (installed once a machine).
GGUF_PARTS = 4
CARRY_ALWAYS = (".gguf/SHA256", ".gguf/tok", ".gguf/python-3.11-docs.tar.xz")
CARRY_FIRST = (".whl",)
SETUP_S = 25  # per call, outside --max-minutes: installing the wheels, joining the GGUF, starting Python


@dataclass(frozen=True)
class Planned:
    """One stage as the plan sees it: expected seconds, the seconds that must be left for it to start, and for
    a training (``stops``) the seconds a resumption costs again."""

    name: str
    seconds: float
    budget: float
    stops: bool = False
    restart: float = 0.0

    @classmethod
    def of(cls, st: Stage) -> Planned:
        return cls(st.name, st.expected().seconds, st.budget(), st.stops, (st.start or st.expected)().seconds)


@dataclass
class Call:
    """One device call of the plan: the stages each lane ran (``shared`` and GPU numbers) and its seconds."""

    index: int
    seconds: float
    ran: dict[str, list[str]]


def carry(index: int) -> tuple[str, ...]:
    """What call ``index`` (from 1) carries: its part of the GGUF while parts remain, the small inputs, and the
    wheels in the first call."""
    part = (f".gguf/smollm2.gguf.part{index - 1:02d}",) if index <= GGUF_PARTS else ()
    return part + CARRY_ALWAYS + (CARRY_FIRST if index == 1 else ())


def simulate(shared: list[Planned], lanes: dict[int, list[Planned]], limit_s: float, gguf_later: bool) -> list[Call]:
    """The calls that run ``shared`` then every lane's stages in calls of ``limit_s`` seconds; with ``gguf_later``
    the conversion waits for the call that carries the GGUF's last part. ValueError naming a stage whose budget
    exceeds a whole call."""
    waiting = list(shared)
    pending = {g: list(lane) for g, lane in lanes.items()}
    calls: list[Call] = []
    while waiting or any(pending.values()):
        parts_missing = gguf_later and len(calls) + 1 < GGUF_PARTS
        ran: dict[str, list[str]] = {"shared": []}
        t = 0.0
        while waiting and not (parts_missing and waiting[0].name == "convert"):
            if t + waiting[0].budget > limit_s:
                break
            t += waiting[0].seconds
            ran["shared"].append(waiting.pop(0).name)
        end = t
        if not waiting:
            for g, lane in pending.items():
                end = max(end, _run_lane(lane, t, limit_s, ran.setdefault(f"GPU {g}", [])))
        if not any(ran.values()) and not parts_missing:
            stuck = waiting[0] if waiting else next(lane[0] for lane in pending.values() if lane)
            raise ValueError(
                f"{stuck.name} needs {stuck.budget:.0f}s left to start, more than a call's {limit_s:.0f}s: raise "
                "--max-minutes or read fewer prompts"
            )
        calls.append(Call(len(calls) + 1, end, {k: v for k, v in ran.items() if v}))
    return calls


def _run_lane(lane: list[Planned], t: float, limit_s: float, ran: list[str]) -> float:
    """Run ``lane``'s stages from ``t`` until the next does not fit (popping those done); returns the lane's end."""
    while lane:
        st = lane[0]
        if t + st.budget > limit_s:
            break
        if st.stops and t + st.seconds > limit_s:
            run = limit_s - t
            lane[0] = replace(st, seconds=st.seconds - run + st.restart)
            ran.append(f"{st.name} (part)")
            return limit_s
        t += st.seconds
        ran.append(lane.pop(0).name)
    return t


def describe(calls: list[Call], gpus: int, limit_s: float, command: str) -> list[str]:
    """The plan as lines: per call its seconds, what it carries and runs; the total; the command."""
    kind = DEVICE_KINDS.get(gpus, f"a {gpus}-GPU kind")
    lines = [
        f"Next session on {kind} ({gpus} GPU(s); a 2-GPU machine counts all its held time): {len(calls)} calls of "
        f"at most {limit_s:.0f}s of stages + ~{SETUP_S}s of setup each (the limit is 600s), to one warm machine:"
    ]
    for call in calls:
        lines.append(f"call {call.index}: ~{call.seconds + SETUP_S:.0f}s; carry {' '.join(carry(call.index))}")
        for lane, names in call.ran.items():
            shown = names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]}"
            lines.append(f"  {lane}: {len(names)} stage(s): {shown}")
    total = sum(c.seconds + SETUP_S for c in calls)
    lines.append(f"total: ~{total / 60:.1f} device-minutes, plus the machine's start")
    lines.append(f"command (every call the same, re-issued while it exits 3): {command}")
    return lines
