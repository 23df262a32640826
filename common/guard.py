"""The reward-hacking guard (docs/guard.md): judges are rewards scored only at evaluation, on the test prompts, never
trained on (`--judge`). At each evaluation the guard compares each judge with its best evaluation so far; the run is
hacking a judge when, for --guard-patience evaluations in a row, the training reward's evaluation is above its value
at the judge's best evaluation while the judge stays more than --guard-margin standard errors below its best (the
standard error of the difference, √(se_best² + se_now²)). What then happens is the mode's: `warn` (one line and a
metrics key), `stop` (a checkpoint, then exit 3 with one line), `rollback` (restore the checkpoint of the judge's
best evaluation, raise the KL weight, go on; stop after --guard-max-rollbacks).

`Guard.observe` is the rule alone, on the evaluation metrics (no model), so it is tested on hand-written
sequences; `common.setup` acts on what it returns. Its state goes into every checkpoint's meta.json, so a resumed
run continues it exactly."""

import math
from dataclasses import dataclass

MODES = ("off", "warn", "stop", "rollback")


@dataclass
class HackingEvent:
    judge: str
    best: float         # the judge's best evaluation …
    best_se: float
    best_epoch: int     # … at this epoch (−1: the untrained model)
    value: float        # the judge now
    value_se: float
    epoch: int          # the evaluation that fired
    reward_at_best: float
    reward: float       # the training reward's evaluation now
    since_epoch: int    # the first evaluation of the streak

    def line(self) -> str:
        return (f"judge {self.judge!r} is {self.value:.4f} ± {self.value_se:.4f} at epoch {self.epoch}, below its "
                f"best {self.best:.4f} ± {self.best_se:.4f} (epoch {self.best_epoch}) since epoch {self.since_epoch}, "
                f"while the training reward's evaluation rose from {self.reward_at_best:.4g} to {self.reward:.4g}")


def judge_key(name: str) -> str:
    """The evaluation metric of a judge (common.evaluation.evaluate_prompts), with its `_se` beside it."""
    return f"eval_judge_{name}"


class Guard:
    def __init__(self, judges: list[str], mode: str = "warn", patience: int = 2, margin: float = 2.0):
        self.judges, self.mode, self.patience, self.margin = list(judges), mode, patience, margin
        # per judge: best, best_se, best_epoch, reward_at_best, streak, since_epoch
        self.state: dict[str, dict] = {}
        self.rollbacks = 0
        self.kl_beta: float | None = None  # the KL weight the last rollback set (None: the flag's)
        self.flag_kl_beta: float | None = None  # --kl-beta as given, once a rollback has changed it
        self.events: list[dict] = []  # every event so far: {"epoch", "judge", "action", "best_epoch"}

    @property
    def active(self) -> bool:
        return self.mode != "off" and bool(self.judges)

    def best_epochs(self) -> set[int]:
        """The epochs of the judges' best evaluations: their checkpoints are kept out of rotation."""
        return {s["best_epoch"] for s in self.state.values()}

    def observe(self, epoch: int, metrics: dict) -> tuple[list[HackingEvent], bool]:
        """Take one evaluation's metrics (eval_reward_mean and each judge's eval_judge_<name>, _se). Returns (the
        judges found hacked at this evaluation, whether some judge reached a new best here). The first evaluation
        of a judge only sets its best."""
        events, new_best = [], False
        reward = metrics["eval_reward_mean"]
        for name in self.judges:
            value, se = metrics[judge_key(name)], metrics[judge_key(name) + "_se"]
            s = self.state.get(name)
            if s is None or value > s["best"]:
                self.state[name] = dict(best=value, best_se=se, best_epoch=epoch, reward_at_best=reward, streak=0,
                                        since_epoch=None)
                new_best = True
                continue
            below = value < s["best"] - self.margin * math.sqrt(s["best_se"] ** 2 + se ** 2)
            if below and reward > s["reward_at_best"]:
                s["streak"] += 1
                s["since_epoch"] = epoch if s["streak"] == 1 else s["since_epoch"]
            else:
                s["streak"], s["since_epoch"] = 0, None
            if s["streak"] >= self.patience:
                events.append(HackingEvent(name, s["best"], s["best_se"], s["best_epoch"], value, se, epoch,
                                           s["reward_at_best"], reward, s["since_epoch"]))
                s["streak"], s["since_epoch"] = 0, None  # the next event needs a new streak
        return events, new_best

    def record(self, event: HackingEvent, action: str) -> None:
        self.events.append({"epoch": event.epoch, "judge": event.judge, "action": action,
                            "best_epoch": event.best_epoch})

    def state_dict(self) -> dict:
        return {"state": self.state, "rollbacks": self.rollbacks, "kl_beta": self.kl_beta,
                "flag_kl_beta": self.flag_kl_beta, "events": self.events}

    def load_state_dict(self, saved: dict) -> None:
        self.state = {k: dict(v) for k, v in saved["state"].items() if k in self.judges}
        self.rollbacks, self.kl_beta, self.events = saved["rollbacks"], saved["kl_beta"], list(saved["events"])
        self.flag_kl_beta = saved["flag_kl_beta"]


def prompt_gap_notes(metrics: dict, noise: float = 2.0) -> list[str]:
    """One line for each reward or judge whose prompt gap (common.evaluation: own − shuffled prompt, measured on
    the untrained model's evaluation samples) is not above `noise` standard errors: it can be maximised without
    following the prompt (JPEG size and the aesthetic head by design; a similarity that ignores the text by
    accident)."""
    lines = []
    for key in sorted(k for k in metrics if k.startswith("prompt_gap_") and not k.endswith("_se")):
        gap, se = metrics[key], metrics[key + "_se"]
        if not gap > noise * se:
            lines.append(f"note: {key[len('prompt_gap_'):]!r} barely depends on the prompt: own − shuffled prompt "
                         f"{gap:.4g} ± {se:.4g} on the untrained model's evaluation samples; it can be maximised "
                         f"without following the prompt (docs/guard.md)")
    return lines
