"""The model side: the Llama-family network, its loader, paged attention (torch and Triton),
the sampler, and the runner that turns a scheduled batch into one forward pass."""
