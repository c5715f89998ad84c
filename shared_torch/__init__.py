"""The torch and vLLM code the trainer and the generator share; the gateway and `shared/` never
import it (a test holds both to that).

`weight_wire` (the wire format of a collective weight transfer over a gloo group), `gloo_weights`
(the gloo weight-transfer engine registered in vLLM, both sides; vLLM loads it through the
``vllm.general_plugins`` entry point) and `nucleus` (the top-p truncation as vLLM's sampler applies
it, for the transformers engine and the trainer's scoring). `shared/` stays the import-light
contracts floor every service imports; this package sits beside it, on the same floor, for the two
services that run torch.
"""
