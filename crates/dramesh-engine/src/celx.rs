//! The only place the engine talks to the CEL runtime (`dramesh-cel`).
//!
//! Errors are typed ([`CelError`]); the search turns them into an
//! [`AllocError`](crate::AllocError) of kind `Cel` whose message adds the class or claim and
//! the selector (a compile or runtime error fails the pod, as in Kubernetes). Each variant
//! displays exactly the runtime's own message.

use dramesh_model::{AttrValue, QualifiedName, Quantity};

pub(crate) use dramesh_cel::{CelEnv, DeviceInput, Limits, Selector};

/// Why a CEL selector cannot say whether it selects a device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum CelError {
    /// The expression does not compile.
    #[error("{0}")]
    Compile(#[from] dramesh_cel::CompileError),
    /// The selector has no CEL expression (a selector type this allocator does not know).
    #[error("CEL expression empty (unsupported selector type?)")]
    NotCel,
    /// Evaluation on the device failed.
    #[error("{0}")]
    Eval(#[from] dramesh_cel::EvalError),
    /// The device has no CEL input (the reason, e.g. an attribute without a value).
    #[error("{0}")]
    NoInput(String),
}

pub(crate) fn compile(env: &CelEnv, expr: &str) -> Result<Selector, CelError> {
    Ok(env.compile(expr)?)
}

pub(crate) fn evaluate(
    env: &CelEnv,
    sel: &Selector,
    input: &DeviceInput,
) -> Result<bool, CelError> {
    Ok(env.evaluate(sel, input)?)
}

pub(crate) fn device_input(
    driver: &str,
    attributes: Vec<(QualifiedName, AttrValue)>,
    capacity: Vec<(QualifiedName, Quantity)>,
    allow_multiple_allocations: bool,
) -> DeviceInput {
    DeviceInput::new(driver, attributes, capacity, allow_multiple_allocations)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each kind displays the runtime's message unchanged (the pod's error quotes it).
    #[test]
    fn errors_keep_their_kind_and_the_runtime_message() {
        let env = CelEnv::new(Limits::default());
        let e = compile(&env, "device.").expect_err("syntax error");
        assert!(matches!(e, CelError::Compile(_)), "{e:?}");
        let direct = env.compile("device.").expect_err("syntax error");
        assert_eq!(e.to_string(), direct.to_string());

        let sel = compile(&env, "device.attributes[\"d\"].missing == 1").expect("compiles");
        let input = device_input("d", Vec::new(), Vec::new(), false);
        let e = evaluate(&env, &sel, &input).expect_err("no such attribute");
        assert!(matches!(e, CelError::Eval(_)), "{e:?}");
        let direct = env.evaluate(&sel, &input).expect_err("no such attribute");
        assert_eq!(e.to_string(), direct.message);

        assert_eq!(
            CelError::NotCel.to_string(),
            "CEL expression empty (unsupported selector type?)"
        );
    }
}
