"""Training the text-to-image DDM, stage by stage, into one diffusers-style directory."""

#: The stages, in the order each reads the ones before it (light: the CLI's parser reads it,
#: and the operator's image, which has no numpy, builds that parser).
STAGES = ("tokenizer", "clip", "vae", "partition", "latents", "expert", "router", "text-prior",
          "monolith", "monolith-snapshot")
