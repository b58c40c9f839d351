"""The models (`models`), their norm layers (`norms`), the layers they share
(`layers`) and the recording of activation statistics (`activations`)."""
