"""Write a Hugging Face model directory to ``model/``: the stand-in for your own model.

With a model of your own, skip this and set ``roles.actor.model`` in ``graph.yaml`` to its directory
(``config.json``, weights, tokenizer files, as ``save_pretrained`` writes them). Here it is flowrl's
``builtin:tiny`` saved as such a directory, so the example needs no download.
"""

from operators.models import load_model, save_model

if __name__ == "__main__":
    model, tokenizer = load_model("builtin:tiny", seed=0)
    print(f"wrote {save_model(model, tokenizer, 'model')}")
