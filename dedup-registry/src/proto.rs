//! Just enough of a `.proto` file to place a record's message type: its
//! package and its message types, nested, in the order protoc gives them
//! (the order a Protobuf frame's message indexes count in). Map fields and
//! proto2 groups declare nested types too, where they stand in the file.
//!
//! Not a compiler: fields, enums, services and options are stepped over.
//! A file protoc would refuse may parse here; only the message tree is
//! trusted, and only to name the type a record says it is.

/// A `.proto` file's package and message types.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct ProtoFile {
    package: String,
    messages: Vec<MessageType>,
}

/// A message type and those nested in it, in declaration order.
#[derive(Debug, PartialEq, Eq)]
struct MessageType {
    name: String,
    /// A map field's entry or a group's type: a nested type protoc makes,
    /// which a parser of the text alone (Confluent's Java client reading the
    /// registry's file) does not count.
    synthetic: bool,
    /// A map field's entry: never a record's type.
    map_entry: bool,
    nested: Vec<MessageType>,
}

/// How a frame's message indexes count a message's nested types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Numbering {
    /// As protoc's descriptors have them, map entries and groups included
    /// (the serializers of Go, Python and .NET, and Java's from a compiled
    /// class).
    Descriptor,
    /// Declared messages only (Confluent's Java client reading the file's
    /// text).
    Declared,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Token<'a> {
    /// An identifier, a dotted name, a keyword or a number.
    Word(&'a str),
    /// A string literal (its text is never needed).
    Str,
    Punct(char),
}

/// What a `{` opened.
enum Block {
    /// A message type (or a group's), being read.
    Message(MessageType),
    /// An enum, a oneof, a service, an option's value...
    Other,
}

impl ProtoFile {
    /// Reads the package and the message tree of `text`.
    pub(crate) fn parse(text: &str) -> Result<ProtoFile, String> {
        let tokens = tokenize(text)?;
        let mut file = ProtoFile::default();
        let mut open: Vec<Block> = Vec::new();
        let mut group: Option<String> = None;
        let mut i = 0;
        let word = |i: usize| match tokens.get(i) {
            Some(Token::Word(w)) => Some(*w),
            _ => None,
        };
        let punct = |i: usize, c: char| tokens.get(i) == Some(&Token::Punct(c));
        while i < tokens.len() {
            let in_message = matches!(open.last(), Some(Block::Message(_)));
            let declares = open.is_empty() || in_message;
            match tokens[i] {
                Token::Word("package") if open.is_empty() => {
                    // `shop.v1`, or `shop . v1` spread over tokens.
                    let end = (i..tokens.len())
                        .find(|&j| punct(j, ';'))
                        .ok_or("`package` has no `;`")?;
                    file.package = (i + 1..end).filter_map(word).collect();
                    if file.package.is_empty() {
                        return Err("`package` is not followed by a name".to_owned());
                    }
                    i = end + 1;
                }
                Token::Punct('[') => {
                    // Field options, `{}` values and all: stepped over.
                    let mut depth = 0usize;
                    let end = (i..tokens.len())
                        .find(|&j| {
                            if punct(j, '[') {
                                depth += 1;
                            } else if punct(j, ']') {
                                depth -= 1;
                            }
                            depth == 0
                        })
                        .ok_or("a `[` is not closed")?;
                    i = end + 1;
                }
                Token::Word("message") if declares && punct(i + 2, '{') => {
                    let name = word(i + 1).ok_or("`message` is not followed by a name")?;
                    open.push(Block::Message(MessageType::new(name)));
                    i += 3;
                }
                Token::Word("map") if in_message && punct(i + 1, '<') => {
                    let close = (i..tokens.len())
                        .find(|&j| punct(j, '>'))
                        .ok_or("a map field's `<` is not closed")?;
                    let field = word(close + 1).ok_or("a map field has no name")?;
                    if let Some(Block::Message(m)) = open.last_mut() {
                        m.nested
                            .push(MessageType::map_entry(&map_entry_name(field)));
                    }
                    i = close + 2;
                }
                Token::Word("group") if punct(i + 2, '=') => {
                    group = word(i + 1).map(str::to_owned);
                    i += 3;
                }
                Token::Punct(';') => {
                    group = None;
                    i += 1;
                }
                Token::Punct('{') => {
                    open.push(match group.take() {
                        Some(name) => Block::Message(MessageType::synthetic(&name)),
                        None => Block::Other,
                    });
                    i += 1;
                }
                Token::Punct('}') => {
                    let Some(closed) = open.pop() else {
                        return Err("a `}` closes nothing".to_owned());
                    };
                    if let Block::Message(m) = closed {
                        // A type nests in the nearest message around it
                        // (a group in a oneof belongs to the oneof's message).
                        let parent = open.iter_mut().rev().find_map(|b| match b {
                            Block::Message(p) => Some(p),
                            Block::Other => None,
                        });
                        match parent {
                            Some(p) => p.nested.push(m),
                            None => file.messages.push(m),
                        }
                    }
                    i += 1;
                }
                _ => i += 1,
            }
        }
        if !open.is_empty() {
            return Err(format!("{} `{{` not closed at the end", open.len()));
        }
        Ok(file)
    }

    /// The full name (`package.Outer.Inner`) of the message type at
    /// `indexes` (each the position among its parent's message types,
    /// counted as `numbering` says), if the file declares one there: a map
    /// entry's type is never taken for a record's (a group's may be).
    pub(crate) fn full_name(&self, indexes: &[i32], numbering: Numbering) -> Option<String> {
        let mut types = &self.messages;
        let mut path = Vec::with_capacity(indexes.len() + 1);
        if !self.package.is_empty() {
            path.push(self.package.as_str());
        }
        let mut last = None;
        for &index in indexes {
            let index = usize::try_from(index).ok()?;
            let m = types
                .iter()
                .filter(|m| numbering == Numbering::Descriptor || !m.synthetic)
                .nth(index)?;
            path.push(&m.name);
            types = &m.nested;
            last = Some(m);
        }
        let m = last?;
        (!m.map_entry).then(|| path.join("."))
    }

    /// The message indexes of the type named `full_name` that read as it
    /// whichever way a reader counts (protoc's count first), if the file
    /// declares it and some do.
    pub(crate) fn unambiguous_indexes(&self, full_name: &str) -> Option<Vec<i32>> {
        [Numbering::Descriptor, Numbering::Declared]
            .into_iter()
            .filter_map(|numbering| self.indexes(full_name, numbering))
            .find(|ix| {
                let (a, b) = (
                    self.full_name(ix, Numbering::Descriptor),
                    self.full_name(ix, Numbering::Declared),
                );
                a.as_deref().or(b.as_deref()) == Some(full_name)
                    && (a.is_none() || b.is_none() || a == b)
            })
    }

    /// The message indexes of the type named `full_name` counted as
    /// `numbering` says, if the file declares it.
    pub(crate) fn indexes(&self, full_name: &str, numbering: Numbering) -> Option<Vec<i32>> {
        let local = if self.package.is_empty() {
            full_name
        } else {
            full_name.strip_prefix(&self.package)?.strip_prefix('.')?
        };
        let mut types = &self.messages;
        let mut indexes = Vec::new();
        for name in local.split('.') {
            let counted = types
                .iter()
                .filter(|m| numbering == Numbering::Descriptor || !m.synthetic);
            let (at, m) = counted.enumerate().find(|(_, m)| m.name == name)?;
            indexes.push(i32::try_from(at).ok()?);
            types = &m.nested;
        }
        Some(indexes)
    }
}

impl MessageType {
    fn new(name: &str) -> Self {
        MessageType {
            name: name.to_owned(),
            synthetic: false,
            map_entry: false,
            nested: Vec::new(),
        }
    }

    fn map_entry(name: &str) -> Self {
        MessageType {
            map_entry: true,
            ..MessageType::synthetic(name)
        }
    }

    fn synthetic(name: &str) -> Self {
        MessageType {
            synthetic: true,
            ..MessageType::new(name)
        }
    }
}

/// The nested type protoc declares for map field `field`: `my_map` gives
/// `MyMapEntry`.
fn map_entry_name(field: &str) -> String {
    let mut name = String::with_capacity(field.len() + 5);
    let mut upper = true;
    for c in field.chars() {
        if c == '_' {
            upper = true;
        } else if upper {
            name.push(c.to_ascii_uppercase());
            upper = false;
        } else {
            name.push(c);
        }
    }
    name + "Entry"
}

fn tokenize(text: &str) -> Result<Vec<Token<'_>>, String> {
    let mut tokens = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        let rest = &text[i..];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if rest.starts_with("//") {
            i += rest.find('\n').unwrap_or(rest.len());
        } else if let Some(comment) = rest.strip_prefix("/*") {
            let end = comment.find("*/").ok_or("a `/*` comment is not closed")?;
            i += end + 4;
        } else if c == b'"' || c == b'\'' {
            let mut j = i + 1;
            loop {
                match bytes.get(j) {
                    None | Some(b'\n') => return Err("a string is not closed".to_owned()),
                    Some(b'\\') => j += 2,
                    Some(&q) if q == c => break,
                    Some(_) => j += 1,
                }
            }
            tokens.push(Token::Str);
            i = j + 1;
        } else if c.is_ascii_alphanumeric() || c == b'_' || c == b'.' {
            let len = rest
                .find(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_' || ch == '.'))
                .unwrap_or(rest.len());
            tokens.push(Token::Word(&rest[..len]));
            i += len;
        } else {
            let ch = rest.chars().next().unwrap_or_default();
            tokens.push(Token::Punct(ch));
            i += ch.len_utf8();
        }
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::Numbering::{Declared, Descriptor};
    use super::ProtoFile;

    impl ProtoFile {
        fn indexes_d(&self, name: &str) -> Option<Vec<i32>> {
            self.indexes(name, Descriptor)
        }
    }

    const FILE: &str = r#"
        // A comment with message Fake { } in it.
        syntax = "proto2";
        package shop.v1;
        import "google/protobuf/timestamp.proto";
        option java_package = "com.shop { message Nope {";

        enum Kind { KIND_A = 0; message = 1; }
        /* message Hidden {} */
        message Order {
          option (my.opt) = { message: "x" nested { a: 1 } };
          message Line { optional string sku = 1 [(v.rules) = { min: 1 }]; }
          map<string, Line> by_sku = 2;
          optional string message = 3;
          oneof pick {
            group Choice = 4 { optional int32 n = 1; }
            string other = 5;
          }
          message Note {}
        }
        service Orders { rpc Get (Order) returns (Order) { option idempotency_level = NO_SIDE_EFFECTS; } }
        message Refund { map<int32, string> line_notes = 1; }
    "#;

    #[test]
    fn message_types_are_numbered_as_protoc_numbers_them() {
        let file = ProtoFile::parse(FILE).unwrap();
        let name = |ix: &[i32]| file.full_name(ix, Descriptor);
        assert_eq!(name(&[0]).as_deref(), Some("shop.v1.Order"));
        assert_eq!(name(&[0, 0]).as_deref(), Some("shop.v1.Order.Line"));
        // The map entry is counted, never taken for a record's type; the
        // group is a type of its own.
        assert_eq!(name(&[0, 1]), None);
        assert_eq!(name(&[0, 2]).as_deref(), Some("shop.v1.Order.Choice"));
        assert_eq!(name(&[0, 3]).as_deref(), Some("shop.v1.Order.Note"));
        assert_eq!(name(&[1]).as_deref(), Some("shop.v1.Refund"));
        assert_eq!(name(&[1, 0]), None);
        assert_eq!(name(&[2]), None);
        assert_eq!(name(&[0, 4]), None);
        assert_eq!(name(&[]), None);
        assert_eq!(file.indexes_d("shop.v1.Order.Note"), Some(vec![0, 3]));
        // Declared messages only, as Confluent's Java client counts them.
        let declared = |ix: &[i32]| file.full_name(ix, Declared);
        assert_eq!(declared(&[0, 1]).as_deref(), Some("shop.v1.Order.Note"));
        assert_eq!(declared(&[0, 2]), None);
        assert_eq!(file.indexes_d("shop.v1.Refund"), Some(vec![1]));
        assert_eq!(file.indexes_d("shop.v2.Refund"), None);
        assert_eq!(file.indexes_d("shop.v1.Fake"), None);
        assert_eq!(file.indexes_d("shop.v1.Hidden"), None);
    }

    #[test]
    fn a_file_without_a_package_names_its_types_alone() {
        let file = ProtoFile::parse("syntax = \"proto3\"; message A {} message B {}").unwrap();
        assert_eq!(file.full_name(&[1], Descriptor).as_deref(), Some("B"));
        assert_eq!(file.indexes_d("A"), Some(vec![0]));
    }

    #[test]
    fn packages_spread_over_tokens_and_options_of_groups_are_read() {
        let file = ProtoFile::parse(
            "syntax = \"proto2\"; package shop /* v */ . v1 ;
             message A {
               optional group G = 1 [(o) = { a: 1 }, deprecated = true] {
                 message In {}
               }
               message B {}
             }",
        )
        .unwrap();
        assert_eq!(file.indexes_d("shop.v1.A.B"), Some(vec![0, 1]));
        assert_eq!(file.indexes_d("shop.v1.A.G.In"), Some(vec![0, 0, 0]));
        assert_eq!(
            file.full_name(&[0, 0], Declared).as_deref(),
            Some("shop.v1.A.B")
        );
        // `[0, 0]` is the group one way and B the other: no indexes of
        // the group read as it both ways; B's protoc indexes do (Java's
        // count has no `[0, 1]`).
        assert_eq!(
            file.full_name(&[0, 0], Descriptor).as_deref(),
            Some("shop.v1.A.G")
        );
        assert_eq!(file.unambiguous_indexes("shop.v1.A.G"), None);
        assert_eq!(file.unambiguous_indexes("shop.v1.A.B"), Some(vec![0, 1]));
    }

    #[test]
    fn unbalanced_files_are_refused() {
        for text in [
            "message A {",
            "message A {}}",
            "message A { string s = 1 [default = \"x]; }",
            "/* open",
            "message A { string s = 1 [deprecated = true; }",
        ] {
            assert!(ProtoFile::parse(text).is_err(), "{text}");
        }
    }
}
