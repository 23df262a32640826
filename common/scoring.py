"""Scoring samples with loaded rewards (rewards/ builds them from `--reward` specs): one call per reward with
its failures turned into one-line errors, groupwise rewards over all processes, and the condition images of
edits and image-to-video for the rewards that want them. Part of `common` so that the training machinery never
imports `rewards/`: the scripts load the rewards and hand them to `setup`."""

import atexit
import os
import threading
import time
import traceback
import weakref
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from common.models.base import AudioVideo
from common.parallel import scored_once
from common.utils import UserError


@dataclass
class Reward:
    name: str
    weight: float
    score: Callable
    groupwise: bool = False
    wants_conditions: bool = False  # called with the samples' condition images (edit, image-to-video rewards)
    video: bool = False  # called with whole clips (B, F, 3, H, W) instead of frame by frame
    wants_audio: bool = False  # called with whole clips and the waveforms (audio-video models)
    judge: bool = False  # --judge: scored at evaluation only, never trained on (common.guard)


def check_video_rewards(rewards: list[Reward], model: str, makes_video: bool) -> None:
    """A reward that judges whole clips cannot score a model that makes images: one line, before anything runs."""
    from common.models.registry import VIDEO_MODELS

    for reward in rewards:
        if reward.video and not makes_video:
            raise UserError(f"reward {reward.name!r} scores video clips, but --model {model} makes images; choose a "
                            f"video model: {', '.join(VIDEO_MODELS)}")


def check_audio_rewards(rewards: list[Reward], model: str, makes_audio: bool) -> None:
    """A reward that scores sound needs a model that makes it: one line before anything is loaded, not at the first
    scoring."""
    wanting = [r.name for r in rewards if r.wants_audio]
    if wanting and not makes_audio:
        raise UserError(f"reward {wanting[0]!r} scores audio, but {model} makes none (use it with an audio-video "
                        f"model: --model ltx2)")


def condition_tensors(paths_per_sample) -> list[list[torch.Tensor]]:
    """Each sample's condition image files as (3, h, w) float tensors in [0, 1] (what a reward that wants
    conditions receives)."""
    from common.data import load_images

    return [[torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255 for image in load_images(paths)]
            for paths in paths_per_sample]


def call_reward(reward: Reward, images, prompts: list[str], conditions=None,
                columns: dict | None = None) -> torch.Tensor:
    """Scores of one call as float64 (B,), off the graph; any failure becomes a one-line UserError naming
    the reward (with where it was raised, since the traceback is not printed). Video (B, F, 3, H, W): every
    frame index is scored as one batch of images and the scores are averaged over frames, unless the reward takes
    whole clips (`video`, which then refuses images) or sound (`wants_audio`). `images` may be an `AudioVideo`
    (audio-video models): a reward that wants audio is called with `audio=` the waveforms (B, channels, samples)
    and `sample_rate=` their rate too; the others see only the frames. `conditions`: each sample's condition
    images (`condition_tensors`), passed to a reward that wants them. A reward may return a dict: its "score"
    entry is the score and every other entry a named column of B numbers (e.g. per-dimension scores), written
    into `columns` as `<reward name>_<key>` (float64 (B,)) when it is given."""
    audio = images if isinstance(images, AudioVideo) else None
    images = audio.video if audio is not None else images
    if reward.wants_audio and audio is None:
        check_audio_rewards([reward], "this model", makes_audio=False)
    if images.ndim == 5 and not (reward.video or reward.wants_audio):
        per_frame = [{} for _ in range(images.shape[1])]
        scores = torch.stack([call_reward(reward, images[:, f], prompts, conditions, per_frame[f])
                              for f in range(images.shape[1])]).mean(0)
        if columns is not None:
            columns.update({key: torch.stack([frame[key] for frame in per_frame]).mean(0) for key in per_frame[0]})
        return scores
    if reward.video and images.ndim != 5:
        raise UserError(f"reward {reward.name!r} scores whole video clips (B, F, 3, H, W), but got images of shape "
                        f"{tuple(images.shape)}: use it with a video model")
    count = len(prompts)
    extra, sound = (), {}
    if reward.wants_conditions:
        if conditions is None or not any(conditions):
            raise UserError(f"reward {reward.name!r} judges samples against their condition images, but these "
                            f"samples have none (train a conditioned model on a dataset with \"image\" fields)")
        extra = (conditions,)
    if reward.wants_audio:
        sound = {"audio": audio.audio.detach(), "sample_rate": audio.sample_rate}
    try:
        with torch.no_grad():
            values = reward.score(images.detach(), list(prompts), *extra, **sound)
    except UserError:
        raise
    except Exception as error:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise UserError(f"reward {reward.name!r} raised {type(error).__name__} at "
                        f"{os.path.basename(frame.filename)}:{frame.lineno}: {message}") from error
    named = {}
    if isinstance(values, dict):
        if "score" not in values:
            raise UserError(f"reward {reward.name!r} returned a dict without a \"score\" entry (keys: "
                            f"{', '.join(map(str, values))})")
        named = {key: value for key, value in values.items() if key != "score"}
        values = values["score"]
    scores = _as_scores(reward, values, count, "")
    for key, value in named.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise UserError(f"reward {reward.name!r} returned a column named {key!r}: use letters, digits and '_'")
        column = _as_scores(reward, value, count, f" in its column {key!r}")
        if columns is not None:
            columns[f"{reward.name}_{key}"] = column
    return scores


def _as_scores(reward: Reward, values, count: int, where: str) -> torch.Tensor:
    """A reward's B numbers as float64 (B,) on the CPU, or a one-line UserError."""
    if isinstance(values, torch.Tensor):
        values = values.detach().to("cpu", torch.float64)
    try:
        values = torch.as_tensor(np.asarray(values, dtype=np.float64))
    except (TypeError, ValueError):
        raise UserError(f"reward {reward.name!r} returned {type(values).__name__}{where}, not {count} numbers") \
            from None
    if values.shape != (count,):
        raise UserError(f"reward {reward.name!r} returned shape {tuple(values.shape)}{where}, expected ({count},)")
    if not torch.isfinite(values).all():
        raise UserError(f"reward {reward.name!r} returned NaN or inf{where} for "
                        f"{int((~torch.isfinite(values)).sum())} of {count} samples")
    return values


def _gather_everything(images, prompts, group_ids, accelerator, conditions):
    """All processes' samples (in rank order) and where this process's start; counts may differ by rank."""
    from common.parallel import gather_objects

    counts = gather_objects(accelerator, [len(prompts)])
    size = max(counts)
    keep = torch.cat([torch.arange(r * size, r * size + c) for r, c in enumerate(counts)])

    def gather_rows(tensor):  # collectives need device tensors (NCCL) of one size on every rank: pad, then unpad
        padded = accelerator.pad_across_processes(tensor.detach().to(accelerator.device).contiguous(), dim=0)
        return accelerator.gather(padded).cpu()[keep]

    all_ids = gather_rows(group_ids)
    all_images = (AudioVideo(gather_rows(images.video), gather_rows(images.audio), images.sample_rate)
                  if isinstance(images, AudioVideo) else gather_rows(images))
    all_prompts = gather_objects(accelerator, list(prompts))
    all_conditions = gather_objects(accelerator, list(conditions)) if conditions is not None else None
    return all_images, all_prompts, all_ids, all_conditions, sum(counts[:accelerator.process_index])


def score_samples(rewards: list[Reward], images, prompts: list[str], group_ids: torch.Tensor,
                  accelerator=None, conditions=None, columns: dict | None = None) -> torch.Tensor:
    """Raw scores (batch, num_rewards), float64 on the CPU, for this process's samples. `conditions`: each
    sample's condition image paths (a tuple, empty for text-only prompts), read only for rewards that want them.
    `columns`: filled with the named columns of rewards that return them (`call_reward`), (batch,) each.

    Groupwise rewards need every sample of a group: the samples of all processes are gathered (once), each
    process scores the groups it leads (round-robin over the sorted group ids), and the scores are summed
    back across processes. All processes must call this together when any reward is groupwise. `accelerator`: an
    Accelerator, or a common.parallel.DataParallel (its data-parallel ranks are the processes here).
    """
    group_ids = torch.as_tensor(group_ids)
    if len(group_ids) != len(prompts) or len(images) != len(prompts):
        raise ValueError(f"{len(images)} images, {len(prompts)} prompts and {len(group_ids)} group ids differ")
    world = accelerator.num_processes if accelerator is not None else 1
    scores, everything = [], None
    loaded = condition_tensors(conditions) if conditions is not None and any(r.wants_conditions for r in rewards) \
        else None
    for reward in rewards:
        if not reward.groupwise:
            scores.append(call_reward(reward, images, prompts, loaded, columns))
            continue
        if everything is None:
            everything = (_gather_everything(images, prompts, group_ids, accelerator, conditions) if world > 1
                          else (images.detach().cpu(), list(prompts), group_ids.cpu(), conditions, 0))
        all_images, all_prompts, all_ids, all_conditions, start = everything
        column = torch.zeros(len(all_prompts), dtype=torch.float64)
        named = {}
        for g, gid in enumerate(torch.unique(all_ids).tolist()):
            if world > 1 and g % world != accelerator.process_index:
                continue
            members = (all_ids == gid).nonzero().flatten()
            group_conditions = (condition_tensors([all_conditions[i] for i in members])
                                if reward.wants_conditions and all_conditions is not None else None)
            group_columns = {}
            column[members] = call_reward(reward, all_images[members.tolist()], [all_prompts[i] for i in members],
                                          group_conditions, group_columns)
            for key, values in group_columns.items():
                named.setdefault(key, torch.zeros(len(all_prompts), dtype=torch.float64))[members] = values
        if world > 1:  # a groupwise reward's named columns stay with the process that scored the group
            column = accelerator.reduce(column.to(accelerator.device), "sum").cpu()
        elif columns is not None:
            columns.update({key: values[start:start + len(prompts)] for key, values in named.items()})
        scores.append(column[start:start + len(prompts)])
    return torch.stack(scores, dim=1)


_LIVE_WORKER_THREADS = weakref.WeakSet()
EXIT_WAIT_S = 20.0  # how long an exiting run waits for reward calls in flight (a preemption's grace is ~30 s)


@atexit.register
def _let_running_calls_end() -> None:
    """Wait (bounded) for reward calls still running when the interpreter exits, e.g. after another reward failed.
    A daemon thread that comes back from a torch op once finalization has begun is ended by pthread_exit inside
    torch's C++ frames, which aborts the process ("terminate called without an active exception", exit 134)
    after the run's one-line error."""
    deadline = time.monotonic() + EXIT_WAIT_S
    for thread in list(_LIVE_WORKER_THREADS):
        thread.join(timeout=max(0.0, deadline - time.monotonic()))


class _RewardWorkers:
    """Daemon threads running scoring calls, each returning a concurrent.futures.Future. Daemon threads, unlike a
    ThreadPoolExecutor's, never hold up the exit of a run that stopped on an error while a call was in flight for
    longer than EXIT_WAIT_S (a stuck remote reward)."""

    def __init__(self, count: int):
        import queue

        self.tasks, self.torch_threads = queue.SimpleQueue(), torch.get_num_threads()
        self.threads = [threading.Thread(target=self._work, name=f"reward-worker-{i}", daemon=True)
                        for i in range(count)]
        for thread in self.threads:
            thread.start()
            _LIVE_WORKER_THREADS.add(thread)

    def _work(self):
        torch.set_num_threads(self.torch_threads)  # OpenMP's team size is per thread: reductions split as the caller's
        while (task := self.tasks.get()) is not None:
            future, call = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as error:  # handed to the thread that collects
                future.set_exception(error)

    def submit(self, call) -> Future:
        future = Future()
        self.tasks.put((future, call))
        return future

    def close(self, wait: bool) -> None:
        for _ in self.threads:
            self.tasks.put(None)
        if wait:
            for thread in self.threads:
                thread.join()


class RolloutScoring:
    """One epoch's scoring, fed one rollout micro-batch at a time (`submit`, in draw order) and read once
    (`collect`): the raw scores (N, R), float64 on the CPU, for this process's N samples.

    Each pointwise reward is called once per micro-batch and each groupwise reward once per group, with the same
    inputs whether `workers` threads score while the rollout goes on or (workers = 0) everything is scored in
    `collect`, in order: the scores are the same bit for bit. A groupwise reward's group is scored as soon as its
    last member is submitted on a single process; with several processes the groups span processes, so they are
    gathered and scored in `collect` (as `score_samples` does). A reward is called by one thread at a time unless
    its score object says `thread_safe = True` (the remote client, which bounds its own connections). The first
    failure is raised at the next `submit` or in `collect`, which then waits for nothing else: nothing half-scored
    comes back. `collect` returns only when no worker is left running. `columns` then holds the named columns of
    rewards that return them (`call_reward`): key -> float64 (N,). Under sequence parallelism (`accelerator` a
    common.parallel.DataParallel of N > 1) only the first process of each group calls the rewards, and `collect`
    hands its scores, or its failure, to the others (`scored_once`): then a failure waits for `collect`."""

    def __init__(self, rewards: list[Reward], prompts: list[str], group_ids: torch.Tensor, conditions=None,
                 accelerator=None, workers: int = 0):
        self.rewards, self.prompts, self.conditions, self.accelerator = rewards, list(prompts), conditions, accelerator
        self.group_ids = torch.as_tensor(group_ids)
        if len(self.group_ids) != len(self.prompts):
            raise ValueError(f"{len(self.prompts)} prompts and {len(self.group_ids)} group ids differ")
        self.world = accelerator.num_processes if accelerator is not None else 1
        self.scores_here = getattr(accelerator, "scores_here", True)  # common.parallel.scored_once
        self.shared = getattr(accelerator, "degree", 1) > 1  # a sequence-parallel group shares the scores
        self.images, self.submitted = [], 0
        self.scores = torch.full((len(self.prompts), len(rewards)), float("nan"), dtype=torch.float64)
        self.columns = {}  # the named columns of rewards that return them (call_reward), filled by `collect`
        self.pending = []  # (future or None, column, rows, call), in submission order
        self.locks = [None if getattr(r.score, "thread_safe", False) else threading.Lock() for r in rewards]
        # A reward that is not thread-safe needs one thread: more would only wait on its lock, and each waiting
        # thread costs the rollout's Python thread GIL hand-offs (measured: +8% on the tiny model's rollout).
        lanes = sum(workers if lock is None else 1 for lock in self.locks)
        self.workers = _RewardWorkers(min(workers, lanes)) if workers > 0 and lanes > 0 and self.scores_here else None
        self.groups = {}  # group id -> its members' positions, for the groupwise rewards scored here
        if self.world == 1 and any(r.groupwise for r in rewards):
            for position, gid in enumerate(self.group_ids.tolist()):
                self.groups.setdefault(gid, []).append(position)

    def _conditions(self, reward: Reward, rows):
        if not reward.wants_conditions or self.conditions is None:
            return None
        return condition_tensors([self.conditions[i] for i in rows])

    def _schedule(self, column: int, rows, images: torch.Tensor) -> None:
        reward, lock = self.rewards[column], self.locks[column]

        def call():
            named = {}
            with lock if lock is not None else nullcontext():
                scores = call_reward(reward, images, [self.prompts[i] for i in rows], self._conditions(reward, rows),
                                     named)
            return scores, named

        self.pending.append((self.workers.submit(call) if self.workers else None, column, rows, call))

    def submit(self, images) -> None:
        """The next micro-batch's decoded images (B, 3, H, W), video (B, F, 3, H, W) or `AudioVideo`, on the CPU."""
        if not self.shared:  # a group's processes stop together, in `collect`
            self._raise_first_failure(done_only=True)
        start, stop = self.submitted, self.submitted + len(images)
        if stop > len(self.prompts):
            raise ValueError(f"{stop} images submitted for {len(self.prompts)} samples")
        if not self.scores_here:
            self.submitted = stop
            return
        if any(r.groupwise for r in self.rewards):  # pointwise calls hold their own micro-batch
            self.images.append(images)
        self.submitted = stop
        for column, reward in enumerate(self.rewards):
            if not reward.groupwise:
                self._schedule(column, range(start, stop), images)
            elif self.world == 1:  # groups completed by this micro-batch
                for members in self.groups.values():
                    if start <= members[-1] < stop:
                        self._schedule(column, members, self._all_images()[members])

    def _all_images(self):
        if len(self.images) > 1:
            self.images = [AudioVideo.cat(self.images) if isinstance(self.images[0], AudioVideo)
                           else torch.cat(self.images)]
        return self.images[0]

    def _raise_first_failure(self, done_only: bool) -> None:
        futures = [p[0] for p in self.pending if p[0] is not None]
        if not done_only:
            wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            if future.done() and not future.cancelled() and future.exception() is not None:
                self.close()
                raise future.exception()

    def close(self) -> None:
        """Cancel what has not started and let the running calls end on their own (daemon threads)."""
        for future, *_ in self.pending:
            if future is not None:
                future.cancel()
        if self.workers is not None:
            self.workers.close(wait=False)
            self.workers = None

    def collect(self) -> torch.Tensor:
        if self.submitted != len(self.prompts):
            raise ValueError(f"{self.submitted} images submitted for {len(self.prompts)} samples")
        self.scores, self.columns = scored_once(self.accelerator, self._score_everything)
        return self.scores

    def _score_everything(self) -> tuple[torch.Tensor, dict]:
        try:
            self._raise_first_failure(done_only=False)
            for future, column, rows, call in self.pending:
                scores, named = future.result() if future is not None else call()
                self.scores[list(rows), column] = scores
                for key, values in named.items():
                    self.columns.setdefault(key, torch.full((len(self.prompts),), float("nan"),
                                                            dtype=torch.float64))[list(rows)] = values
        except BaseException:
            self.close()
            raise
        if self.workers is not None:
            self.workers.close(wait=True)
            self.workers = None
        if self.world > 1 and any(r.groupwise for r in self.rewards):
            groupwise = [k for k, r in enumerate(self.rewards) if r.groupwise]
            self.scores[:, groupwise] = score_samples([self.rewards[k] for k in groupwise], self._all_images(),
                                                      self.prompts, self.group_ids, self.accelerator, self.conditions)
        return self.scores, self.columns
