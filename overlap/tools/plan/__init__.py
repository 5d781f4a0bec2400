"""Planning on the step model's virtual clock (overlap/step_model/: the cost model, the runtime's
schedule replayed, the calibration): model and GPU presets (`models`), one config's prediction
(`estimate`), the config search (`search`), the scaling curve (`scaling`), measuring a
calibration (`calibrate`, `measure`) and the `overlap plan` command (`command`).

Nothing is imported here. `cost`, `simulate`, `calibration` and `online` here are the old paths of
the step model's modules, kept for one release.
"""
