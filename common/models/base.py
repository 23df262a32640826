"""What every adapter shares: loading a pipeline's components, parking the frozen text encoders on the CPU,
autocast to the model dtype, and writing LoRA weights in the pipeline's own format."""

from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from common.utils import UserError


def component_class_name(model_path: str, component: str) -> str | None:
    """The class the pipeline at `model_path` names for `component` in its model_index.json; None when it names
    none or the config cannot be read (loading the pipeline then says why)."""
    import diffusers

    try:
        entry = diffusers.DiffusionPipeline.load_config(model_path).get(component) or [None, None]
    except (OSError, ValueError):
        return None
    return entry[1]


def lora_metadata(transformer, adapter_name: str, layers: dict[str, torch.Tensor]) -> dict | None:
    """The peft config of `transformer`'s (unwrapped) adapter, as a LoRA file's metadata. A LoRA that leaves out
    `unused_modules` names exactly the file's `layers` as its targets: the loader injects LoRA where the file has
    keys, and peft warns at a config that targets more layers or excludes none of them."""
    config = getattr(transformer, "peft_config", {}).get(adapter_name)
    if config is None:
        return None
    metadata = config.to_dict()
    if metadata.get("exclude_modules"):
        metadata.update(target_modules=sorted({key.split(".lora_")[0] for key in layers}), exclude_modules=None)
    return metadata


class AudioVideo:
    """What an audio-video model's `decode` returns: `video` (batch, F, 3, H, W) in [0, 1] and `audio`, waveforms
    (batch, channels, samples) at `sample_rate` Hz, both float32. It goes where other models' decoded images go
    (`scoring.submit(adapter.decode(x, cond).cpu())`): rows index, concatenate and move together, and common/scoring.py
    gives the frames to every reward and the waveforms to those that want them."""

    def __init__(self, video: torch.Tensor, audio: torch.Tensor, sample_rate: int):
        if len(video) != len(audio):
            raise ValueError(f"{len(video)} videos and {len(audio)} waveforms differ")
        self.video, self.audio, self.sample_rate = video, audio, int(sample_rate)

    def __len__(self) -> int:
        return len(self.video)

    def __getitem__(self, rows) -> "AudioVideo":
        rows = [rows] if isinstance(rows, int) else rows
        return AudioVideo(self.video[rows], self.audio[rows], self.sample_rate)

    def cpu(self) -> "AudioVideo":
        return AudioVideo(self.video.cpu(), self.audio.cpu(), self.sample_rate)

    def detach(self) -> "AudioVideo":
        return AudioVideo(self.video.detach(), self.audio.detach(), self.sample_rate)

    @staticmethod
    def cat(parts: list["AudioVideo"]) -> "AudioVideo":
        return AudioVideo(torch.cat([p.video for p in parts]), torch.cat([p.audio for p in parts]),
                          parts[0].sample_rate)


class FirstFrameConditioned:
    """Image-to-video adapters whose one condition image per prompt is the video's first frame: it is resized to
    the output size, so a `--condition-size` other than `--resolution` is refused."""

    condition_images = (1, 1)

    def _check_condition_size(self, condition_size: int | None, resolution: int) -> None:
        if condition_size is not None and condition_size != resolution:
            raise UserError(f"--condition-size {condition_size} differs from --resolution {resolution}: for "
                            f"{self.display_name} the condition image is the video's first frame, at the output size")

    def condition_shape(self, width: int, height: int) -> tuple[int, int]:
        """Every condition image becomes the output size."""
        return self.height, self.width

    def _check_one_image_each(self, prompts: list[str], images: list[list]) -> None:
        if len(images) != len(prompts) or any(len(group) != 1 for group in images):
            raise ValueError(f"{self.display_name} takes exactly one condition image per prompt")


class _Adapter:
    """What the adapters share: loading a pipeline's components, parking the frozen text encoders on the CPU,
    autocast to the model dtype, and writing LoRA weights in the pipeline's own format."""

    pipeline_class_name: str
    # Other pipelines whose checkpoints (model_index.json's _class_name) hold the same components: LTX-2's one
    # checkpoint names LTX2Pipeline and loads as LTX2ImageToVideoPipeline too.
    also_loads: tuple[str, ...] = ()
    display_name: str
    text_components: tuple[str, ...]  # skipped when training from the embedding cache
    true_cfg = False
    max_sequence_limit: int | None = None  # the longest prompt the text encoder path accepts, when bounded
    # Conditioned models (editing, image-to-video): how many condition images a prompt carries, fewest and most
    # (None: any number; fewest 0: optional, Qwen-Image 2.1's text-to-image rows have none), and the components that
    # encode them, which preprocess.py loads beside the text encoders.
    # Their `encode_prompts(texts, images)` returns the condition tensors with the text embeddings, so the cache
    # and every script carry them in the same `cond` dict that `velocity` reads.
    condition_images: tuple[int, int | None] = (0, 0)
    video = False  # decodes (batch, frames, 3, H, W) and takes num_frames
    audio = False  # decodes an AudioVideo (frames and waveforms) from one joint latent
    condition_components: tuple[str, ...] = ()
    # Why --sequence-parallel cannot split this model although its transformer has a plan (None: it can).
    sequence_parallel_refusal: str | None = None
    model_components: tuple[str, ...] = ("transformer", "vae")  # what text_only (preprocess.py) leaves unloaded
    # Modules of a block, by their name inside it, that only feed the block's text stream: the last block's text
    # stream is read by nothing when every block is dual-stream to the end (Qwen-Image, HunyuanVideo-1.5).
    last_block_text_outputs: tuple[str, ...] = ()

    def unused_modules(self, transformer) -> list[str]:
        """Modules of `transformer` (unwrapped) whose output never reaches the model's output, so no gradient
        reaches their weights; DDP stops at the first step on a trained weight without one, so LoRA leaves them out
        and full fine-tuning freezes them. The last block's index is read off the loaded model, so the names hold for
        the real checkpoint's depth as for the tiny model's."""
        if not self.last_block_text_outputs:
            return []
        last = len(transformer.transformer_blocks) - 1
        return [f"transformer_blocks.{last}.{name}" for name in self.last_block_text_outputs]

    def _load(self, model_path: str, device, dtype: torch.dtype, load_text_encoders: bool, text_only: bool,
              max_sequence_length: int) -> None:
        import diffusers

        limit = self.max_sequence_limit
        if limit is not None and not 0 < max_sequence_length <= limit:
            raise UserError(f"max_sequence_length {max_sequence_length} is not in 1..{limit}, "
                            f"as {self.display_name} requires")
        self.max_sequence_length = max_sequence_length
        self.device = torch.device(device)
        self.dtype = dtype
        # Frozen encoders wait on the CPU between uses when training on an accelerator.
        self.offload_device = torch.device("cpu")
        skip = {} if load_text_encoders else {name: None for name in self.text_components}
        if text_only:  # preprocess.py: only the text encoders (and what encodes the conditions)
            skip.update({name: None for name in self.model_components if name not in self.condition_components})
        try:
            found = diffusers.DiffusionPipeline.load_config(model_path).get("_class_name")
            if found != self.pipeline_class_name and found not in self.also_loads:
                raise ValueError(f"its model_index.json names {found}, not "
                                 f"{' or '.join((self.pipeline_class_name, *self.also_loads))}")
            self.pipe = getattr(diffusers, self.pipeline_class_name).from_pretrained(model_path, dtype=dtype, **skip)
        except (OSError, ValueError) as err:
            raise UserError(f"cannot load a {self.display_name} pipeline from {model_path!r}: "
                            f"{str(err).splitlines()[0]}") from err
        self.pipe.set_progress_bar_config(disable=True)
        self.text_encoders = [getattr(self.pipe, name) for name in self.text_components
                              if name.startswith("text_encoder") and getattr(self.pipe, name, None) is not None]
        for module in self.text_encoders:
            module.requires_grad_(False).to(self.offload_device)
        for name in self.condition_components:  # frozen, used only under no_grad
            getattr(self.pipe, name).to(self.device).requires_grad_(False)
        if text_only:
            return
        self.transformer = self.pipe.transformer.to(self.device).requires_grad_(False)
        self.config = self.transformer.config  # the scripts may wrap `transformer` (DDP): read config from here
        self.vae = self.pipe.vae.to(self.device).requires_grad_(False)
        self.scheduler = self.pipe.scheduler

    def set_attention_backend(self, backend: str, backward: bool = True) -> None:
        """Run every transformer of the pipeline (both of Wan2.2's experts) on diffusers' attention `backend`, after
        checking on a small attention call, in the model's dtype on its device (and its backward when training),
        that the backend runs here: a missing package, a kernel this device lacks or a forward-only kernel is
        refused with one line, not found at the first forward of the first epoch."""
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry, dispatch_attention_fn

        names = [name for name in self.model_components if name.startswith("transformer")]
        processors = [module.processor for name in names for module in getattr(self.pipe, name).modules()
                      if getattr(module, "processor", None) is not None]
        if not any(hasattr(processor, "_attention_backend") for processor in processors):
            kinds = sorted({type(processor).__name__ for processor in processors})
            raise UserError(f"--attention-backend: {self.display_name}'s attention processors "
                            f"({', '.join(kinds)}) do not go through diffusers' attention dispatcher, so they take "
                            f"no backend; leave the flag unset")
        # set_attention_backend also makes the backend the process-wide default (of every module whose processor
        # names none): put the old default back if the backend turns out not to run
        default = _AttentionBackendRegistry.get_active_backend()[0]
        try:
            for name in names:
                getattr(self.pipe, name).set_attention_backend(backend)
            with torch.enable_grad() if backward else torch.no_grad():
                # not drawn from the global RNG: a run with the flag draws its LoRA init and noise as one without
                query = torch.linspace(-1, 1, 16 * 2 * 64, device=self.device).reshape(1, 16, 2, 64)
                query = query.to(self.dtype).requires_grad_(backward)
                out = dispatch_attention_fn(query, query, query, backend=backend)
                if backward:
                    out.float().sum().backward()
        except (RuntimeError, ValueError, NotImplementedError, ImportError) as err:
            for name in names:
                getattr(self.pipe, name).reset_attention_backend()
            _AttentionBackendRegistry.set_active_backend(default)
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(f"--attention-backend {backend} cannot run {'training ' if backward else ''}on "
                            f"{self.device.type} in {str(self.dtype).removeprefix('torch.')}: {first}") from None

    def _check_resolution(self, resolution: int, multiple: int, largest: int | None = None) -> None:
        if resolution <= 0 or resolution % multiple or (largest is not None and resolution > largest):
            limit = f" up to {largest}" if largest is not None else ""
            raise UserError(f"resolution {resolution} is not a positive multiple of {multiple}{limit}, "
                            f"as {self.display_name} requires")

    @contextmanager
    def text_encoders_on_device(self):
        """Bring the frozen text encoders to the accelerator for a round of encoding, then back to the CPU."""
        for module in self.text_encoders:
            module.to(self.device)
        try:
            yield
        finally:
            for module in self.text_encoders:
                module.to(self.offload_device)

    def encode_entry(self, text: str, image_paths: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """The conditioning of one text and its condition images (read from their files), batch of one: what the
        embedding cache stores per entry and what online encoding computes, by the same call."""
        if not self.condition_images[1] == 0:
            from common.data import load_images

            return self.encode_prompts([text], [load_images(image_paths)])
        return self.encode_prompts([text])

    def condition_shape(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) a condition image of this size is resized to (conditioned adapters say how)."""
        raise NotImplementedError(f"{self.display_name} takes no condition images")

    def check_condition_shapes(self, records) -> None:
        """Every condition image of a run must become one shape, so that rows of different prompts batch (and
        cache) together; else one line naming the first record that differs."""
        if self.condition_images[1] == 0:
            return
        from common.data import condition_image_size

        first = None
        for record in records:
            for path in record.images:
                shape = self.condition_shape(*condition_image_size(path))
                if first is None:
                    first = (shape, record.source)
                elif shape != first[0]:
                    raise UserError(f"{record.source}: its condition image becomes {shape[1]}×{shape[0]} but "
                                    f"{first[1]}'s becomes {first[0][1]}×{first[0][0]}: one run needs one size; give "
                                    f"--condition-size N (a square) or images of one aspect ratio")

    def count_truncated(self, texts: list[str]) -> int:
        """How many of `texts` are longer than max_sequence_length tokens of the sequence encoder (T5, UMT5 or the
        Qwen2.5-VL text): the pipelines truncate them silently. 0 when the tokenizers were not loaded (cache)."""
        tokenizer = self._sequence_tokenizer()
        if tokenizer is None:
            return 0
        return sum(len(tokenizer(text).input_ids) > self.max_sequence_length for text in texts)

    def _sequence_tokenizer(self):
        """The sequence encoder's tokenizer (None when not loaded)."""
        return getattr(self.pipe, self.long_tokenizer, None)

    def _require_text_encoders(self) -> None:
        if not self.text_encoders:
            raise RuntimeError("text encoders were not loaded (training from the embedding cache)")

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype) if self.dtype != torch.float32 else nullcontext()

    def _with_negatives(self, cond: dict[str, torch.Tensor], guidance_scale: float) -> bool:
        """True CFG is on when guidance_scale > 1 (as in the pipelines); it needs the negative embeddings."""
        if guidance_scale <= 1:
            return False
        missing = [k for k in cond if not k.startswith("negative_") and f"negative_{k}" not in cond]
        if missing:
            raise ValueError(f"guidance_scale {guidance_scale} > 1 needs negative prompt embeddings "
                             f"(negative_{missing[0]}): encode with common.cache.PromptEncoder")
        return True

    @staticmethod
    def attention_pairs(tokens: int, queries: int, keys: int, attention_kwargs: dict) -> int:
        """The query-key pairs one attention call of the transformer computes, for the FLOP count (common/flops.py):
        `tokens` the input's, `queries` and `keys` as the count reads them off the call, whose keyword arguments are
        `attention_kwargs`. Every query against every key; a model whose attention computes fewer says so here."""
        return queries * keys

    @staticmethod
    def _cfg_combine(out: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """True CFG on a [negative; positive] batch, as the pipelines combine it: v_neg + w·(v_pos − v_neg)."""
        uncond, text = out.chunk(2)
        return uncond + guidance_scale * (text - uncond)

    def save_lora(self, directory: str | Path, lora_state_dict: dict[str, torch.Tensor],
                  adapter_name: str = "default") -> None:
        """Write LoRA weights in the diffusers format the matching pipeline's `load_lora_weights` reads, with the
        adapter's peft config as metadata: without it the loader assumes lora_alpha = r, which rescales any
        LoRA trained with α ≠ r (e.g. r 64, α 128)."""
        import diffusers

        getattr(diffusers, self.pipeline_class_name).save_lora_weights(
            str(directory), transformer_lora_layers=lora_state_dict, safe_serialization=True,
            transformer_lora_adapter_metadata=lora_metadata(self.pipe.transformer, adapter_name, lora_state_dict))
