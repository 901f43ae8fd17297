"""The built-in models and data sets the shipped configs use, registered by short name.

This package only registers names (the registries are ``trainrun.registry``'s): each name is
registered with where its class lives, so importing this package imports no model; a config
imports only the classes it names.
"""

from trainrun.registry import DATASETS, METRICS, MODELS

MODELS.register("DigitsMLP", "trainrun.examples.digits:DigitsMLP")
MODELS.register("HFGPT2", "trainrun.examples.hf_gpt2:HFGPT2")  # needs the extra hf
MODELS.register("HFLlama", "trainrun.examples.hf_llama:HFLlama")  # needs the extra hf
MODELS.register("TinyLM", "trainrun.examples.tinylm:TinyLM")
MODELS.register("ToyGAN", "trainrun.examples.gan:ToyGAN")

DATASETS.register("digits", "trainrun.examples.digits:DigitsDataset")
DATASETS.register("char_corpus", "trainrun.examples.tinylm:CharCorpus")
DATASETS.register("char_lines", "trainrun.examples.tinylm:CharLines")
DATASETS.register("gaussian_mixture", "trainrun.examples.gan:GaussianMixture")

METRICS.register("mode_distance", "trainrun.runner.evaluation:MeanOf", name="mode_distance")
