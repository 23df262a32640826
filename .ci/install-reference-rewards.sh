#!/usr/bin/env bash
# The reward models' published packages in a venv of their own, .venv-reference, for the tests that compare this
# package's rewards with them (tests/test_rewards_hpsv3_reference.py). Those packages pin transformers 4.45.2, which
# cannot share a venv with the project's transformers 5, so:
# - everything installs with --no-deps at the versions below (pip then never resolves a CUDA torch, and never
#   touches the project's venv);
# - torch and the other shared packages come from the project's venv through a .pth file, added after the installs
#   (paths from a .pth come after the venv's own site-packages, so the pins below win);
# - the registry's torchvision 0.28 (torch 2.13's) is a CUDA build whose C ops do not load beside the CPU torch, and
#   its import stops on the missing `torchvision::nms`: a second .pth defines nms/qnms before torchvision is first
#   imported, after which its pure-PyTorch transforms (all the references use) work.
# Usage: bash .ci/install-reference-rewards.sh [PROJECT_PYTHON]   (default .venv/bin/python, the venv .ci/run makes)
set -euo pipefail
cd "$(dirname "$0")/.."
project_python=${1:-.venv/bin/python}
project_site=$("$project_python" -c 'import sysconfig, torch; print(sysconfig.get_paths()["purelib"])')

"$project_python" -m venv --clear .venv-reference
reference_site=$(.venv-reference/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
packages=(
  # the references
  hpsv3==1.0.0
  # their transformers and what it needs at versions of its time
  transformers==4.45.2 tokenizers==0.20.3 huggingface-hub==0.26.5 accelerate==1.0.1 peft==0.13.2
  # torch 2.13's torchvision
  torchvision==0.28.0
  # what hpsv3's inferencer imports (through its trainer module): trl, datasets, matplotlib, omegaconf, fire, pandas
  trl==0.11.4 datasets==3.0.1 pyarrow==26.0.1 dill==0.3.8 multiprocess==0.70.16
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 multidict==7.2.1
  propcache==0.5.4 yarl==1.25.1
  pandas==3.1.2 python-dateutil==2.9.0.post0 pytz==2026.6 tzdata==2026.6
  matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.69.1 kiwisolver==1.5.1 pyparsing==3.3.3
  omegaconf==2.4.0 antlr4-python3-runtime==4.9.3 fire==0.7.1 termcolor==3.3.0
)
.venv-reference/bin/pip install -q --no-deps "${packages[@]}"

echo "$project_site" > "$reference_site/project-venv.pth"
cat > "$reference_site/torchvision_ops_shim.py" <<'EOF'
"""Defines torchvision's nms/qnms op schemas just before torchvision is first imported (its CUDA build's C ops do not
load beside the CPU torch; without the schemas its import stops). Written by .ci/install-reference-rewards.sh."""
import importlib.abc
import sys


class DefineOpsFirst(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch

            for op in ("nms", "qnms"):
                torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        return None


sys.meta_path.insert(0, DefineOpsFirst())
EOF
echo "import torchvision_ops_shim" > "$reference_site/torchvision-ops-shim.pth"

.venv-reference/bin/python -c 'import transformers, hpsv3.inference; assert transformers.__version__ == "4.45.2"'
echo "reference venv ready: .venv-reference (transformers 4.45.2, hpsv3 1.0.0)"
