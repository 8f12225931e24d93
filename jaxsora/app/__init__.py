"""`python -m jaxsora.app CKPT`: a checkpoint in the browser (Open-Sora 1.2's Gradio app over jaxsora's sampling
pipeline). `offer`: what the page offers for a checkpoint; `service`: the queue-of-one sampling service;
`page`: the Gradio page (the only module that imports Gradio); `__main__`: the command."""
