//! One accumulator for the macro's errors, so every problem is reported at
//! once and combined the same way everywhere (serde_derive's `Ctxt`).

/// Errors collected while parsing and checking; [`finish`](Errors::finish)
/// turns them into one `syn::Error` that renders as several
/// `compile_error!`s, each on its own token.
#[derive(Default)]
pub(crate) struct Errors(Option<syn::Error>);

impl Errors {
    pub(crate) fn push(&mut self, error: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(error),
            None => self.0 = Some(error),
        }
    }

    /// Keeps the value of `result`, recording its error.
    pub(crate) fn ok<T>(&mut self, result: syn::Result<T>) -> Option<T> {
        result.map_err(|e| self.push(e)).ok()
    }

    /// `Ok` when nothing was pushed.
    pub(crate) fn finish(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proc_macro2::Span;

    #[test]
    fn keeps_every_error_in_order() {
        let mut errors = Errors::default();
        assert_eq!(errors.ok(Ok::<_, syn::Error>(1)), Some(1));
        errors.push(syn::Error::new(Span::call_site(), "first"));
        let second: syn::Result<()> = Err(syn::Error::new(Span::call_site(), "second"));
        assert_eq!(errors.ok(second), None);
        let all: Vec<String> = errors
            .finish()
            .unwrap_err()
            .into_iter()
            .map(|e| e.to_string())
            .collect();
        assert_eq!(all, ["first", "second"]);
        assert!(Errors::default().finish().is_ok());
    }
}
