"""Where a command's ranks run: `launch` (torchrun's world or a spawned local one), `link` (ranks
behind an emulated network link) and `runner` (the one of those a benchmark run asks for)."""
