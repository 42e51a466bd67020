"""What the launcher's fork server imports once, so that no rank pays for it again.

A rank forked from the server finds these modules already loaded: torch and atorch (every rank), and
the Hugging Face model classes the test zoo, the conformance matrix and the benchmarks build (about
1.5 s a rank when each imports them itself). A package that is not installed is skipped: the ranks
that need it then import it, or fail, as they would have without the server.
"""
from __future__ import annotations

import importlib

import atorch  # noqa: F401  (torch, DTensor, FSDP2, pipelining, dynamo: most of a rank's start-up)
import atorch.testing.launcher  # noqa: F401

HF_MODEL_CLASSES = (
    "LlamaForCausalLM GPT2LMHeadModel MixtralForCausalLM Qwen3MoeForCausalLM Qwen2MoeForCausalLM OlmoeForCausalLM "
    "ViTForImageClassification T5ForConditionalGeneration SwinForImageClassification RobertaForMaskedLM "
    "Qwen3ForCausalLM Qwen2ForCausalLM Phi3ForCausalLM Olmo2ForCausalLM OPTForCausalLM MptForCausalLM "
    "ModernBertForMaskedLM MistralForCausalLM Llama4ForCausalLM GptOssForCausalLM GemmaForCausalLM "
    "GPTNeoXForCausalLM GPTNeoForCausalLM GPTBigCodeForCausalLM FalconForCausalLM DeepseekV3ForCausalLM "
    "DebertaV2ForMaskedLM CLIPModel BertForMaskedLM BloomForCausalLM CohereForCausalLM JambaForCausalLM"
).split()


def _import_hf_model_classes() -> None:
    """Resolve transformers' lazy attributes, which imports each class's modeling module."""
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        return
    for name in HF_MODEL_CLASSES:
        try:
            getattr(transformers, name)
        except (ImportError, AttributeError):  # an older or newer transformers without this class
            pass


_import_hf_model_classes()
