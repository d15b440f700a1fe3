"""Diagnoses end to end, each calling the stages in order: a forward pass in one process or
against a trace (forward), a decoding (decoding), the ranks of torchrun (ranks), a compiled B
module by module (compiled) and which of several changes explains how much (attribution)."""
