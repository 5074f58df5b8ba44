"""hf_eagle2: EAGLE-2 dynamic-tree speculative decoding inside Hugging Face `transformers` generate().

    import hf_eagle2
    draft = hf_eagle2.EagleDraftModel.from_pretrained("model_cards/smollm2-135m-instruct-eagle2")
    out = model.generate(input_ids, assistant_model=draft, tree="eagle2", max_new_tokens=256)
"""

from transformers import AutoConfig, AutoModel

from .engine.candidate_generator import EagleCandidateGenerator
from .heads.configuration_eagle import Eagle3Config, EagleConfig
from .kernels.cpu import optimize_for_cpu
from .engine.decoding import EagleGenerateOutput, eagle_generate
from .engine.drafter import EagleDrafter, TreeOptions
from .integration import register, unregister
from .heads.modeling_eagle import EagleDraftModel
from .heads.modeling_eagle3 import Eagle3DraftModel
from .engine.stats import EagleStats
from .engine.tree import EAGLE1_TREE, DraftTree, build_dynamic_tree, build_static_tree

__version__ = "0.1.0"

__all__ = [
    "EAGLE1_TREE",
    "DraftTree",
    "EagleCandidateGenerator",
    "Eagle3Config",
    "Eagle3DraftModel",
    "EagleConfig",
    "EagleDrafter",
    "EagleDraftModel",
    "EagleGenerateOutput",
    "EagleStats",
    "TreeOptions",
    "build_dynamic_tree",
    "build_static_tree",
    "eagle_generate",
    "optimize_for_cpu",
    "register",
    "unregister",
]

try:
    AutoConfig.register("eagle", EagleConfig)
    AutoModel.register(EagleConfig, EagleDraftModel)
    AutoConfig.register("eagle3", Eagle3Config)
    AutoModel.register(Eagle3Config, Eagle3DraftModel)
except ValueError:  # already registered (module reloaded)
    pass

register()
