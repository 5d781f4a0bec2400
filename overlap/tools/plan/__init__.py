"""Planning on a virtual clock: the cost model (`cost`), the runtime's schedule replayed
(`simulate`), model and GPU presets (`models`), one config's prediction (`estimate`), the config
search (`search`), the scaling curve (`scaling`) and the `overlap plan` command (`command`).

Nothing is imported here, so `import overlap.tools.plan.cost` stays light.
"""
