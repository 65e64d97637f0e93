//! Parsing `#[idempotent(key = "...", ttl = "...", scope = "...", crate = "...", batch, ...)]`;
//! `key` may name several parts, separated by `,`.

use proc_macro2::{Span, TokenStream};
use syn::LitStr;
use syn::meta::ParseNestedMeta;

use crate::errors::Errors;

const VALID: &str = "valid options: `key`, `ttl`, `scope`, `crate`, `batch`, `fingerprint`, `lease`, `format`, `decode`";
const EXAMPLE: &str = r#"#[idempotent(key = "event_id", ttl = "4h")]"#;

/// Where one part of the event id comes from.
pub(crate) enum KeySource {
    /// A field path on the event: `["meta", "event_id"]`.
    Field(Vec<syn::Member>),
    /// A message header.
    Header(String),
}

/// One part of `key`: `"event_id"`, or each of `"tenant_id, header:event-id"`.
pub(crate) struct KeyPart {
    /// The part as written (trimmed): named by errors about it.
    pub(crate) text: String,
    pub(crate) source: KeySource,
}

/// What a claim remembers of its event's content (`fingerprint`).
pub(crate) enum FingerprintSource {
    /// The whole payload, byte for byte: the flag alone.
    Payload,
    /// Some fields: `fingerprint = "account_id, amount_cents"`, each as
    /// written and as a path; and where the literal is, for errors.
    Fields(Vec<(String, Vec<syn::Member>)>, Span),
}

/// How a payload becomes the event.
pub(crate) enum Decode {
    /// `format = "json"`, and the default.
    Json,
    /// `format = "protobuf"`: prost, through dedup-core's `protobuf` feature;
    /// where the literal is, for errors.
    Protobuf(Span),
    /// `decode = path::to::fn`: `fn(&[u8]) -> Result<Event, E>`.
    With(syn::Path),
}

/// The parsed, validated options.
pub(crate) struct Args {
    /// One part, or several for a composite key.
    pub(crate) key: Vec<KeyPart>,
    /// The `key` literal, for spans and the field name in errors.
    pub(crate) key_lit: LitStr,
    pub(crate) ttl_secs: u64,
    pub(crate) scope: Option<LitStr>,
    pub(crate) krate: Option<syn::Path>,
    /// The body takes `Vec<Event>`: all claimed events of a batch at once.
    pub(crate) batch: bool,
    pub(crate) fingerprint: Option<FingerprintSource>,
    /// Lease mode: the lease's length in seconds; the body takes
    /// `&Lease` instead of a transaction.
    pub(crate) lease_secs: Option<u64>,
    pub(crate) decode: Decode,
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
    let mut fingerprint: Option<Option<LitStr>> = None;
    let mut lease = None;
    let mut format: Option<LitStr> = None;
    let mut decode: Option<syn::Path> = None;
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
        } else if meta.path.is_ident("fingerprint") {
            let fields = if meta.input.peek(syn::Token![=]) {
                Some(meta.value()?.parse::<LitStr>()?)
            } else {
                None
            };
            set_once(&mut fingerprint, &meta, fields)
        } else if meta.path.is_ident("lease") {
            let lit: LitStr = meta.value()?.parse()?;
            set_once(&mut lease, &meta, lit)
        } else if meta.path.is_ident("format") {
            let lit: LitStr = meta.value()?.parse()?;
            set_once(&mut format, &meta, lit)
        } else if meta.path.is_ident("decode") {
            let value = meta.value()?;
            if value.peek(LitStr) {
                let lit: LitStr = value.parse()?;
                return Err(syn::Error::new(
                    lit.span(),
                    "`decode` names a function, not a string: #[idempotent(decode = my_crate::decode_event, ...)]",
                ));
            }
            let path: syn::Path = value.parse()?;
            set_once(&mut decode, &meta, path)
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
    let fingerprint = match fingerprint {
        None => None,
        Some(None) => Some(FingerprintSource::Payload),
        Some(Some(lit)) => errors.ok(parse_fingerprint(&lit)),
    };
    let lease_secs = lease.and_then(|lit| {
        if batch.is_some() {
            errors.push(syn::Error::new(
                lit.span(),
                "`lease` and `batch` do not combine: each leased event is its own effect",
            ));
        }
        errors.ok(dedup_ttl::parse_secs(&lit.value()).map_err(|e| syn::Error::new(lit.span(), e)))
    });
    let decode = match (format, decode) {
        (Some(lit), Some(_)) => {
            errors.push(syn::Error::new(
                lit.span(),
                "`format` and `decode` do not combine: `decode` is the whole decoding",
            ));
            None
        }
        (None, Some(path)) => Some(Decode::With(path)),
        (None, None) => Some(Decode::Json),
        (Some(lit), None) => match lit.value().as_str() {
            "json" => Some(Decode::Json),
            "protobuf" => Some(Decode::Protobuf(lit.span())),
            other => {
                errors.push(syn::Error::new(
                    lit.span(),
                    format!(
                        "unknown format {other:?}: `format` is \"json\" (the default) or \"protobuf\"; for anything else, `decode = path::to::fn`"
                    ),
                ));
                None
            }
        },
    };
    errors.finish()?;
    Ok(Args {
        key: key_parsed.expect("checked above"),
        key_lit: key.expect("checked above"),
        ttl_secs: ttl_secs.expect("checked above"),
        scope,
        krate,
        batch: batch.is_some(),
        fingerprint,
        lease_secs,
        decode: decode.expect("checked above"),
    })
}

/// `fingerprint = "..."`: fields of the event, separated by `,`.
fn parse_fingerprint(lit: &LitStr) -> syn::Result<FingerprintSource> {
    let value = lit.value();
    let mut fields: Vec<(String, Vec<syn::Member>)> = Vec::new();
    let mut errors = Errors::default();
    for text in value.split(',').map(str::trim) {
        let error = |message: String| syn::Error::new(lit.span(), message);
        if text.is_empty() {
            errors.push(error(format!(
                "`fingerprint` names fields of the event separated by `,`, as in \"account_id, amount_cents\" (or is a flag alone: the whole payload); got {value:?}"
            )));
        } else if text.starts_with("header:") {
            errors.push(error(format!(
                "`fingerprint` hashes fields of the event, not headers; got {text:?}"
            )));
        } else if fields.iter().any(|(seen, _)| seen == text) {
            errors.push(error(format!(
                "the fingerprint field `{text}` is given twice"
            )));
        } else if let Some(KeySource::Field(path)) = errors.ok(parse_part(lit, text)) {
            fields.push((text.to_owned(), path));
        }
    }
    errors.finish()?;
    Ok(FingerprintSource::Fields(fields, lit.span()))
}

/// `key`: one part, or several separated by `,` (a composite key).
fn parse_key(lit: &LitStr) -> syn::Result<Vec<KeyPart>> {
    let value = lit.value();
    let mut parts: Vec<KeyPart> = Vec::new();
    let mut errors = Errors::default();
    for text in value.split(',').map(str::trim) {
        if text.is_empty() && value.contains(',') {
            errors.push(syn::Error::new(
                lit.span(),
                format!(
                    "`key` has an empty part; the parts of a composite key are separated by `,`, as in \"tenant_id, event_id\"; got {value:?}"
                ),
            ));
            continue;
        }
        if parts.iter().any(|p| p.text == text) {
            errors.push(syn::Error::new(
                lit.span(),
                format!("the key part `{text}` is given twice"),
            ));
            continue;
        }
        if let Some(source) = errors.ok(parse_part(lit, text)) {
            parts.push(KeyPart {
                text: text.to_owned(),
                source,
            });
        }
    }
    errors.finish()?;
    Ok(parts)
}

fn parse_part(lit: &LitStr, text: &str) -> syn::Result<KeySource> {
    if let Some(header) = text.strip_prefix("header:").map(str::trim) {
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
                "`key` must be a field path of the event (\"event_id\", \"meta.event_id\") or \"header:<name>\", or several of them separated by `,`; got {text:?}"
            ),
        )
    };
    if text.is_empty() {
        return Err(bad());
    }
    text.split('.')
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
        let [part] = &args.key[..] else {
            panic!("one part")
        };
        let KeySource::Field(path) = &part.source else {
            panic!("field")
        };
        assert_eq!(path.len(), 2);
        assert_eq!(args.ttl_secs, 5400);
        assert_eq!(args.scope.unwrap().value(), "s");
        assert!(args.krate.is_some());
        let args = parse(quote!(ttl = "4h", key = "header:event-id")).unwrap();
        assert!(matches!(&args.key[0].source, KeySource::Header(h) if h == "event-id"));
        let args = parse(quote!(ttl = "4h", key = " tenant.id ,header: event-id,seq")).unwrap();
        let texts: Vec<_> = args.key.iter().map(|p| p.text.as_str()).collect();
        assert_eq!(texts, ["tenant.id", "header: event-id", "seq"]);
        assert!(matches!(&args.key[1].source, KeySource::Header(h) if h == "event-id"));
    }

    #[test]
    fn fingerprint_is_a_flag_or_fields() {
        let args = parse(quote!(key = "id", ttl = "1h", fingerprint)).unwrap();
        assert!(matches!(args.fingerprint, Some(FingerprintSource::Payload)));
        let args = parse(quote!(key = "id", ttl = "1h", fingerprint = "a, m.b")).unwrap();
        let Some(FingerprintSource::Fields(fields, _)) = args.fingerprint else {
            panic!("fields")
        };
        let names: Vec<_> = fields.iter().map(|(text, _)| text.as_str()).collect();
        assert_eq!(names, ["a", "m.b"]);
        assert_eq!(fields[1].1.len(), 2);
        assert!(
            parse(quote!(key = "id", ttl = "1h"))
                .unwrap()
                .fingerprint
                .is_none()
        );
        let msg = err(quote!(
            key = "id",
            ttl = "1h",
            fingerprint = "a,,a-b, header:x, a"
        ));
        for part in [
            "separated by `,`",
            "got \"a-b\"",
            "not headers",
            "`a` is given twice",
        ] {
            assert!(msg.contains(part), "{part}: {msg}");
        }
        assert!(err(quote!(key = "id", ttl = "1h", fingerprint, fingerprint)).contains("twice"));
    }

    #[test]
    fn lease_takes_a_duration() {
        let args = parse(quote!(key = "id", ttl = "4h", lease = "30s")).unwrap();
        assert_eq!(args.lease_secs, Some(30));
        assert!(err(quote!(key = "id", ttl = "4h", lease = "0s")).contains("longer than zero"));
        assert!(
            err(quote!(key = "id", ttl = "4h", lease = "30s", batch)).contains("do not combine")
        );
    }

    #[test]
    fn format_or_decode_chooses_the_decoding() {
        let args = parse(quote!(key = "id", ttl = "1h")).unwrap();
        assert!(matches!(args.decode, Decode::Json));
        let args = parse(quote!(key = "id", ttl = "1h", format = "json")).unwrap();
        assert!(matches!(args.decode, Decode::Json));
        let args = parse(quote!(key = "id", ttl = "1h", format = "protobuf")).unwrap();
        assert!(matches!(args.decode, Decode::Protobuf(_)));
        let args = parse(quote!(key = "id", ttl = "1h", decode = wire::decode_paid)).unwrap();
        let Decode::With(path) = args.decode else {
            panic!("decode")
        };
        assert_eq!(quote!(#path).to_string(), "wire :: decode_paid");
        assert!(
            err(quote!(key = "id", ttl = "1h", format = "avro"))
                .contains("unknown format \"avro\"")
        );
        assert!(
            err(quote!(key = "id", ttl = "1h", format = "json", decode = f))
                .contains("do not combine")
        );
        assert!(err(quote!(key = "id", ttl = "1h", decode = "f")).contains("not a string"));
        assert!(err(quote!(key = "id", ttl = "1h", decode = f, decode = g)).contains("twice"));
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
        assert!(err(quote!(key = "a,", ttl = "1h")).contains("empty part"));
        assert!(err(quote!(key = "a,,b", ttl = "1h")).contains("empty part"));
        assert!(err(quote!(key = "a, b, a", ttl = "1h")).contains("`a` is given twice"));
        let msg = err(quote!(key = "a-b, header:, c", ttl = "1h"));
        assert!(
            msg.contains(r#"got "a-b""#) && msg.contains("header name"),
            "{msg}"
        );
    }
}
