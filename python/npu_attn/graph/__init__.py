"""Graph mode: ``npu_attn.compile`` (torch.compile with the chosen strategy inside) and the passes
it runs on frozen graphs (oneDNN linears, Winograd convolutions)."""
