"""Run a repo script (`python tests/image_only_processor.py SCRIPT ARGS...`) with `Qwen2VLProcessor` made of its
image processor and tokenizer only, when transformers would add a video processor that needs torchvision
(transformers 5; no CPU build of torchvision installs beside this project's CPU torch). The Edit pipeline feeds the
processor images only, so what it computes is unchanged. For the tests of qwen-image-edit; see also
test_qwen_image_edit.py, which checks the one-line error a real run gives without torchvision."""

import runpy
import sys


def image_only_processor() -> None:
    from transformers import Qwen2VLProcessor

    from common.models.qwen_image_edit import processor_needs_torchvision

    if processor_needs_torchvision():
        Qwen2VLProcessor.get_attributes = classmethod(lambda cls: ["image_processor", "tokenizer"])


if __name__ == "__main__":
    image_only_processor()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
