//! Parsing `#[idempotent(key = "...", ttl = "...", scope = "...", crate = "...", batch)]`.

use proc_macro2::{Span, TokenStream};
use syn::LitStr;
use syn::meta::ParseNestedMeta;

use crate::errors::Errors;

const VALID: &str = "valid options: `key`, `ttl`, `scope`, `crate`, `batch`";
const EXAMPLE: &str = r#"#[idempotent(key = "event_id", ttl = "4h")]"#;

/// Where the event id comes from.
pub(crate) enum KeySource {
    /// A field path on the event: `["meta", "event_id"]`.
    Field(Vec<syn::Member>),
    /// A message header.
    Header(String),
}

/// The parsed, validated options.
pub(crate) struct Args {
    pub(crate) key: KeySource,
    /// The `key` literal, for spans and the field name in errors.
    pub(crate) key_lit: LitStr,
    pub(crate) ttl_secs: u64,
    pub(crate) scope: Option<LitStr>,
    pub(crate) krate: Option<syn::Path>,
    /// The body takes `Vec<Event>`: all claimed events of a batch at once.
    pub(crate) batch: bool,
}

/// Stores `value` in `slot` unless the option was given before: the one
/// place a repeated option is caught.
fn set_once<T>(slot: &mut Option<T>, meta: &ParseNestedMeta<'_>, value: T) -> syn::Result<()> {
    if slot.is_some() {
        let name = quote::ToTokens::to_token_stream(&meta.path).to_string();
        return Err(meta.error(format!("option `{name}` is given twice")));
    }
    *slot = Some(value);
    Ok(())
}

pub(crate) fn parse(attr: TokenStream) -> syn::Result<Args> {
    let mut key = None;
    let mut ttl = None;
    let mut scope = None;
    let mut krate = None;
    let mut batch = None;
    let parser = syn::meta::parser(|meta| {
        if meta.path.is_ident("key") {
            let lit: LitStr = meta.value()?.parse()?;
            set_once(&mut key, &meta, lit)
        } else if meta.path.is_ident("ttl") {
            let lit: LitStr = meta.value()?.parse()?;
            set_once(&mut ttl, &meta, lit)
        } else if meta.path.is_ident("scope") {
            let lit: LitStr = meta.value()?.parse()?;
            set_once(&mut scope, &meta, lit)
        } else if meta.path.is_ident("batch") {
            if meta.input.peek(syn::Token![=]) {
                return Err(
                    meta.error("`batch` is a flag and takes no value: #[idempotent(batch, ...)]")
                );
            }
            set_once(&mut batch, &meta, ())
        } else if meta.path.is_ident("crate") {
            let lit: LitStr = meta.value()?.parse()?;
            set_once(&mut krate, &meta, lit)
        } else {
            let name = quote::ToTokens::to_token_stream(&meta.path).to_string();
            Err(meta.error(format!("unknown option `{name}`; {VALID}")))
        }
    });
    syn::parse::Parser::parse2(parser, attr)?;

    let mut errors = Errors::default();
    let missing = |name: &str| {
        syn::Error::new(
            Span::call_site(),
            format!("missing required option `{name}`, as in {EXAMPLE}"),
        )
    };
    let key_parsed = match &key {
        Some(lit) => errors.ok(parse_key(lit)),
        None => {
            errors.push(missing("key"));
            None
        }
    };
    let ttl_secs = match &ttl {
        Some(lit) => errors
            .ok(dedup_ttl::parse_secs(&lit.value()).map_err(|e| syn::Error::new(lit.span(), e))),
        None => {
            errors.push(missing("ttl"));
            None
        }
    };
    if let Some(lit) = scope.as_ref().filter(|lit| lit.value().is_empty()) {
        errors.push(syn::Error::new(lit.span(), "`scope` must not be empty"));
    }
    let krate = krate.and_then(|lit| errors.ok(lit.parse::<syn::Path>()));
    errors.finish()?;
    Ok(Args {
        key: key_parsed.expect("checked above"),
        key_lit: key.expect("checked above"),
        ttl_secs: ttl_secs.expect("checked above"),
        scope,
        krate,
        batch: batch.is_some(),
    })
}

fn parse_key(lit: &LitStr) -> syn::Result<KeySource> {
    let value = lit.value();
    if let Some(header) = value.strip_prefix("header:") {
        if header.is_empty() {
            return Err(syn::Error::new(
                lit.span(),
                "`header:` needs a header name, as in \"header:event-id\"",
            ));
        }
        return Ok(KeySource::Header(header.to_owned()));
    }
    let bad = || {
        syn::Error::new(
            lit.span(),
            format!(
                "`key` must be a field path of the event (\"event_id\", \"meta.event_id\") or \"header:<name>\"; got {value:?}"
            ),
        )
    };
    if value.is_empty() {
        return Err(bad());
    }
    value
        .split('.')
        .map(|segment| {
            let mut member = syn::parse_str::<syn::Member>(segment).map_err(|_| bad())?;
            // Located on the literal, so "no field" errors point at what the
            // user wrote; with the macro's context, so rustc offers no
            // "similar field" fix, which would replace the whole literal,
            // quotes included, by a bare name the attribute refuses.
            let span = Span::call_site().located_at(lit.span());
            match &mut member {
                syn::Member::Named(ident) => ident.set_span(span),
                syn::Member::Unnamed(index) => index.span = span,
            }
            Ok(member)
        })
        .collect::<syn::Result<Vec<_>>>()
        .map(KeySource::Field)
}

#[cfg(test)]
mod tests {
    use super::*;
    use quote::quote;

    fn err(tokens: TokenStream) -> String {
        parse(tokens)
            .err()
            .expect("must be rejected")
            .into_iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join(" | ")
    }

    #[test]
    fn parses_every_option() {
        let args = parse(quote!(
            key = "meta.event_id",
            ttl = "1h30m",
            scope = "s",
            crate = "my::dedup"
        ))
        .unwrap();
        let KeySource::Field(path) = &args.key else {
            panic!("field")
        };
        assert_eq!(path.len(), 2);
        assert_eq!(args.ttl_secs, 5400);
        assert_eq!(args.scope.unwrap().value(), "s");
        assert!(args.krate.is_some());
        let args = parse(quote!(ttl = "4h", key = "header:event-id")).unwrap();
        assert!(matches!(args.key, KeySource::Header(h) if h == "event-id"));
    }

    #[test]
    fn reports_every_problem_at_once() {
        let msg = err(quote!(ttl = "0s"));
        assert!(msg.contains("missing required option `key`"), "{msg}");
        assert!(msg.contains("must be longer than zero"), "{msg}");
    }

    #[test]
    fn rejects_bad_keys() {
        assert!(err(quote!(key = "", ttl = "1h")).contains("field path"));
        assert!(err(quote!(key = "a..b", ttl = "1h")).contains("field path"));
        assert!(err(quote!(key = "event-id", ttl = "1h")).contains("field path"));
        assert!(err(quote!(key = "header:", ttl = "1h")).contains("header name"));
    }
}
