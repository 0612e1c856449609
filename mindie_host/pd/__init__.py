"""PD disaggregation (``inferMode: "dmi"``): the builtin KV transport and the front end's per-request part."""
