"""What the tests share: the local world of gloo ranks (harness), small models, tolerances."""
